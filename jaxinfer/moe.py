"""Sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE, DeepSeek-V2/V3) with expert parallelism.

Runs per device inside the model's `shard_map` (manual SPMD) on local shards: experts split on the
`expert` mesh axis, each expert's F split on `tensor`, the router replicated. With every axis of
`par` at 1 it is the plain single-device block, with no collectives.

1. Route (`route`): router logits in f32 over all X experts, softmax (or DeepSeek-V3's sigmoid),
   optionally limited to the best `topk_group` of `n_group` expert groups (DeepSeek), `jax.lax.top_k`
   (on the scores plus V3's correction bias, which picks experts but does not weight them),
   optional renormalisation of the k weights, then `routed_scaling_factor`. Padding tokens
   (`valid` False) get the sentinel expert id X and weight 0, so they never reach an expert.
2. Dispatch, one of (`moe_mlp(..., dispatch=)`, rule in `choose_dispatch`):
   a. "replicated": every device holds all T tokens; it keeps the assignments of its own
      X_local experts (ids `par.index(EXPERT) * X_local + [0, X_local)`), the rest are unrouted.
   b. "all_to_all": device i of the expert axis routes only tokens [i*T/ep, (i+1)*T/ep) and sends
      each assignment's row to the device owning its expert, then gets the results back. With
      `ragged=True` (GPU/TPU) that is `jax.lax.ragged_all_to_all` (only real rows travel); otherwise a
      capacity-padded `jax.lax.all_to_all` that runs everywhere, drop-free by construction.
3. Experts (`_grouped_ffn`): rows sorted by local expert, group sizes counted (unrouted rows fall
   past the last group), `jax.lax.ragged_dot` for gate/up and down, rows put back in order. On
   XLA:CPU a step of at most `GATHER_MAX_ROWS` rows gathers each row's expert weights instead.
4. Combine: each assignment's output times its router weight, summed per token.

Returns a PARTIAL [T, E]: the sum over this device's experts and F slice (and, for all_to_all, only
this device's token rows). The caller completes it with `par.psum(out, EXPERT, TENSOR)`, the same
call for both dispatches. NOTE: for all_to_all that psum stands in for an all-gather of the token
shards (about twice the bytes) so that the model has one MoE contract whatever the dispatch.

Einsum legend: t = token, e = embed, x = expert, f = expert MLP hidden, k = expert slot of a token.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jaxinfer import layers
from jaxinfer.config import ModelConfig
from jaxinfer.quantization import QArray
from jaxinfer.sharding import EXPERT, Parallel
from pallas_kernels import target

# NOTE: below this many tokens per step the replicated dispatch is used even when all_to_all is
# possible: decode steps and small prefills are latency-bound, and the replicated path needs no
# collective besides the caller's psum. Above it, every device gathering and sorting all T*k
# assignment rows (replicated) should cost more than two all-to-alls of T*k/ep rows each. The
# crossover is a design estimate, not a measurement (no multi-accelerator machine was available).
A2A_MIN_TOKENS = 1024

# NOTE: with at most this many assignment rows (single-stream decode: T*k = k) on XLA:CPU, each
# row's expert weights are gathered and applied directly instead of ragged_dot, which XLA:CPU
# lowers to X_local masked dense dots. Measured (8 experts, E=512, F=1024, whole expert FFN):
# 1 row 1.2 ms vs 37 ms, 4 rows 7 ms vs 43 ms, 8 rows 39 ms vs 50 ms, 16 rows 75 ms vs 44 ms.
GATHER_MAX_ROWS = 8

DISPATCHES = ("auto", "replicated", "all_to_all")


@struct.dataclass
class MoEParams:
    router: Any  # [E, X]  replicated
    gate_up: Any  # [X, E, 2, F]  gate and up projections of every expert fused (or a QArray)
    down: Any  # [X, F, E]  (or a QArray)
    router_bias: Any = None  # f32[X] DeepSeek-V3's e_score_correction_bias (expert choice only)


@struct.dataclass
class Routing:
    weights: jax.Array  # f32[T, k]  0 for padding tokens
    experts: jax.Array  # i32[T, k]  global expert ids; X (no expert) for padding tokens


def route(
    x: jax.Array,
    router: jax.Array,
    cfg: ModelConfig,
    valid: jax.Array,
    bias: jax.Array | None = None,
) -> Routing:
    """Top-k routing of `x` [T, E] over all experts (f32), padding tokens unrouted.

    `bias` f32[X] (DeepSeek-V3) is added to the scores that choose the experts, not to the weights.
    """
    with jax.named_scope("router"):
        logits = jnp.einsum("te,ex->tx", x.astype(jnp.float32), router.astype(jnp.float32))
        if cfg.scoring_func == "sigmoid":
            probs = jax.nn.sigmoid(logits)
        else:
            probs = jax.nn.softmax(logits, axis=-1)
        choice = probs if bias is None else probs + bias.astype(jnp.float32)
        if cfg.topk_method != "greedy" and cfg.n_group > 1:
            choice = _limit_to_groups(choice, cfg)
        if choice is probs:
            weights, experts = jax.lax.top_k(probs, cfg.num_experts_per_tok)
        else:
            _, experts = jax.lax.top_k(choice, cfg.num_experts_per_tok)
            weights = jnp.take_along_axis(probs, experts, axis=-1)
        if cfg.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        if cfg.routed_scaling_factor != 1.0:
            weights = weights * cfg.routed_scaling_factor
        valid = valid[:, None]
        return Routing(
            weights=jnp.where(valid, weights, 0.0),
            experts=jnp.where(valid, experts, cfg.num_experts).astype(jnp.int32),
        )


def _limit_to_groups(choice: jax.Array, cfg: ModelConfig) -> jax.Array:
    """choice f32[T, X] with every expert outside the token's best `topk_group` groups at -inf.

    A group's rank: its best expert (V2 "group_limited_greedy") or its best two summed (V3
    "noaux_tc"). NOTE: a group of experts is a contiguous id range X/n_group wide.
    """
    t, x = choice.shape
    grouped = choice.reshape(t, cfg.n_group, x // cfg.n_group)
    if cfg.topk_method == "noaux_tc":
        group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # f32[T, n_group]
    else:
        group_score = jnp.max(grouped, axis=-1)
    _, best = jax.lax.top_k(group_score, cfg.topk_group)  # i32[T, topk_group]
    keep = jnp.any(best[:, :, None] == jnp.arange(cfg.n_group)[None, None, :], axis=1)
    return jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(t, x)


def group_sizes(local_ids: jax.Array, num_local: int) -> jax.Array:
    """i32[num_local] rows per local expert; ids outside [0, num_local) are not counted."""
    # NOTE: negative ids are masked explicitly: JAX index updates wrap negative indices.
    inside = (local_ids >= 0) & (local_ids < num_local)
    return (
        jnp.zeros((num_local,), jnp.int32)
        .at[jnp.where(inside, local_ids, num_local)]
        .add(1, mode="drop")
    )


def choose_dispatch(num_tokens: int, par: Parallel, dispatch: str = "auto") -> str:
    """The documented rule: all_to_all for large steps whose tokens split evenly over `expert`."""
    if dispatch not in DISPATCHES:
        raise ValueError(f"dispatch must be one of {DISPATCHES}, got {dispatch!r}")
    can_a2a = par.expert > 1 and num_tokens % par.expert == 0
    if dispatch == "all_to_all" and not can_a2a:
        raise ValueError(
            f"all_to_all dispatch needs an expert axis > 1 that divides the {num_tokens} "
            f"tokens (expert={par.expert}); use dispatch='replicated'"
        )
    if dispatch == "auto":
        return "all_to_all" if can_a2a and num_tokens >= A2A_MIN_TOKENS else "replicated"
    return dispatch


def default_ragged() -> bool:
    """ragged_all_to_all is implemented by XLA on GPU and TPU, not on CPU."""
    return target.platform() in ("gpu", "tpu")


def moe_mlp(
    x: jax.Array,
    p: MoEParams,
    cfg: ModelConfig,
    par: Parallel,
    valid: jax.Array,
    *,
    dispatch: str = "auto",
    ragged: bool | None = None,
) -> jax.Array:
    """Sparse MoE block on local shards; returns the partial sum the caller psums.

    Args:
      x: [T, E] tokens, the same on every device of the `expert` and `tensor` axes.
      p: local shards: router [E, X], gate_up [X_local, E, 2, F_local], down [X_local, F_local, E].
      par: static mesh axis sizes (all 1 on a single device).
      valid: bool[T], False for padding tokens (the model passes `step.slot_mapping >= 0`).
      dispatch: "auto" (see `choose_dispatch`), "replicated" or "all_to_all".
      ragged: all_to_all via `ragged_all_to_all` (default: on GPU/TPU) or capacity-padded.
    Returns:
      [T, E] partial output; `par.psum(out, EXPERT, TENSOR)` gives the block's output.
    """
    num_local = p.gate_up.shape[0]
    if num_local * par.expert != cfg.num_experts:
        raise ValueError(
            f"{cfg.num_experts} experts do not split into {par.expert} expert shards of "
            f"{num_local}; make num_experts divisible by the expert axis"
        )
    mode = choose_dispatch(x.shape[0], par, dispatch)
    with jax.named_scope("moe"):
        if mode == "replicated":
            return _replicated(x, p, cfg, par, valid)
        if ragged is None:
            ragged = default_ragged()
        return (_ragged_a2a if ragged else _padded_a2a)(x, p, cfg, par, valid)


def _values(w: jax.Array | QArray, dtype: Any) -> jax.Array:
    """The stored expert weights in the compute dtype (quantized: unscaled; see `_scaled`)."""
    return (w.data if isinstance(w, QArray) else w).astype(dtype)


def _scaled(y: jax.Array, w: jax.Array | QArray, ids: jax.Array) -> jax.Array:
    """y [N, ...] (rows through expert `ids` [N]) times those experts' output-channel scales."""
    if not isinstance(w, QArray):
        return y
    scale = jnp.take(w.scale, ids, axis=0).astype(jnp.float32)
    return (y * scale.reshape(y.shape)).astype(y.dtype)


def _grouped_ffn(rows: jax.Array, local_ids: jax.Array, p: MoEParams, act: str) -> jax.Array:
    """rows [N, E] through expert `local_ids[i]` each ([N]; out of range -> zero row).

    Quantized experts (`QArray`, scales [X, 2, F] and [X, E]) multiply by their stored values and
    scale each row's product by its expert's output-channel scales.
    """
    num_local, e, _, f = p.gate_up.shape
    routed = (local_ids >= 0) & (local_ids < num_local)
    if rows.shape[0] <= GATHER_MAX_ROWS and target.platform() == "cpu":
        with jax.named_scope("experts_gathered"):
            ids = jnp.where(routed, local_ids, 0)
            gate_up = jnp.take(_values(p.gate_up, rows.dtype), ids, axis=0)  # [N, E, 2, F]
            gu = _scaled(jnp.einsum("ne,necf->ncf", rows, gate_up), p.gate_up, ids)
            h = layers.activation(act, gu[:, 0]) * gu[:, 1]
            down = jnp.take(_values(p.down, rows.dtype), ids, axis=0)  # [N, F, E]
            ys = _scaled(jnp.einsum("nf,nfe->ne", h, down), p.down, ids)
            return jnp.where(routed[:, None], ys, 0)
    with jax.named_scope("experts"):
        key = jnp.where(routed, local_ids, num_local)
        order = jnp.argsort(key, stable=True)
        sizes = group_sizes(key, num_local)
        xs = jnp.take(rows, order, axis=0)
        sorted_ids = jnp.minimum(
            jnp.take(key, order), num_local - 1
        )  # scales of the past-end rows: unused
        # NOTE: rows past sum(sizes) (the unrouted ones, sorted last) belong to no group:
        # ragged_dot leaves them zero and the where below makes sure of it. XLA:CPU (jaxlib
        # 0.10.2) lowers ragged_dot to a masked dense dot per group, i.e. X_local times the work
        # (measured: 2 rows x 8 experts of [512, 1024] ~10 ms vs ~1 ms gathering 2 experts).
        gate_up = _values(p.gate_up, xs.dtype).reshape(num_local, e, 2 * f)
        gu = _scaled(jax.lax.ragged_dot(xs, gate_up, sizes), p.gate_up, sorted_ids)
        h = layers.activation(act, gu[:, :f]) * gu[:, f:]
        ys = _scaled(jax.lax.ragged_dot(h, _values(p.down, h.dtype), sizes), p.down, sorted_ids)
        ys = jnp.where((jnp.arange(ys.shape[0]) < jnp.sum(sizes))[:, None], ys, 0)
        return jnp.zeros_like(ys).at[order].set(ys, unique_indices=True)


def _replicated(x, p, cfg, par, valid):
    t, k = x.shape[0], cfg.num_experts_per_tok
    num_local = p.gate_up.shape[0]
    r = route(x, p.router, cfg, valid, p.router_bias)
    local = (r.experts - par.index(EXPERT) * num_local).reshape(
        t * k
    )  # assignment (t, j) at row t*k + j
    ys = _grouped_ffn(jnp.repeat(x, k, axis=0), local, p, cfg.activation)
    with jax.named_scope("combine"):
        return jnp.einsum("tke,tk->te", ys.reshape(t, k, -1), r.weights.astype(ys.dtype))


def _local_tokens(x, valid, par):
    """This device's contiguous 1/ep of the tokens (the all_to_all dispatches' token shard)."""
    t_local = x.shape[0] // par.expert
    start = par.index(EXPERT) * t_local
    return (
        jax.lax.dynamic_slice_in_dim(x, start, t_local),
        jax.lax.dynamic_slice_in_dim(valid, start, t_local),
        start,
    )


def _place_local(out_local, t, start):
    """Local token rows into a zero [T, E] (the caller's psum over `expert` fills the rest)."""
    out = jnp.zeros((t,) + out_local.shape[1:], out_local.dtype)
    return jax.lax.dynamic_update_slice_in_dim(out, out_local, start, axis=0)


def _padded_a2a(x, p, cfg, par, valid):
    """Capacity-padded all_to_all: a [ep, C, E] send buffer, C = T_local * min(k, X_local).

    NOTE: drop-free by construction: a token sends at most min(k, X_local) rows to one device (its
    k experts are distinct), so no destination can receive more than C rows from one source.
    """
    t, k, ep = x.shape[0], cfg.num_experts_per_tok, par.expert
    num_local = p.gate_up.shape[0]
    x_l, valid_l, start = _local_tokens(x, valid, par)
    t_l = x_l.shape[0]
    cap = t_l * min(k, num_local)
    r = route(x_l, p.router, cfg, valid_l, p.router_bias)
    with jax.named_scope("dispatch"):
        eid = r.experts.reshape(t_l * k)
        dest = jnp.where(eid < cfg.num_experts, eid // num_local, ep)  # ep: unrouted
        # Slot of each assignment within its destination: its rank among same-destination rows.
        onehot = (dest[:, None] == jnp.arange(ep)[None, :]).astype(jnp.int32)  # [A, ep]
        slot = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=1)
        rows = jnp.repeat(x_l, k, axis=0)
        send_x = jnp.zeros((ep, cap, x.shape[1]), x.dtype).at[dest, slot].set(rows, mode="drop")
        send_e = (
            jnp.full((ep, cap), num_local, jnp.int32)
            .at[dest, slot]
            .set(eid % num_local, mode="drop")
        )
        recv_x = jax.lax.all_to_all(send_x, EXPERT, 0, 0)
        recv_e = jax.lax.all_to_all(send_e, EXPERT, 0, 0)
    ys = _grouped_ffn(recv_x.reshape(ep * cap, -1), recv_e.reshape(ep * cap), p, cfg.activation)
    with jax.named_scope("combine"):
        back = jax.lax.all_to_all(ys.reshape(ep, cap, -1), EXPERT, 0, 0)
        got = back.at[dest, slot].get(mode="fill", fill_value=0)  # [A, E]; unrouted -> 0
        out_l = jnp.einsum("tke,tk->te", got.reshape(t_l, k, -1), r.weights.astype(got.dtype))
        return _place_local(out_l, t, start)


def _ragged_a2a(x, p, cfg, par, valid):
    """ragged_all_to_all: assignments sorted by expert (so by destination) travel as one ragged
    array per destination; the receive buffer holds T*k rows, the most any device can get."""
    t, k, ep = x.shape[0], cfg.num_experts_per_tok, par.expert
    num_local = p.gate_up.shape[0]
    x_l, valid_l, start = _local_tokens(x, valid, par)
    t_l = x_l.shape[0]
    a = t_l * k
    r = route(x_l, p.router, cfg, valid_l, p.router_bias)
    with jax.named_scope("dispatch"):
        eid = r.experts.reshape(a)
        order = jnp.argsort(eid, stable=True)  # unrouted (id X) last
        send_sizes = group_sizes(jnp.where(eid < cfg.num_experts, eid // num_local, ep), ep)
        in_offsets = jnp.cumsum(send_sizes) - send_sizes
        # recv_sizes[s]: rows source s sends me. My rows land on device d after those of the
        # sources before me: out_offsets = (exclusive cumsum over sources on d), sent back to me.
        recv_sizes = jax.lax.all_to_all(send_sizes, EXPERT, 0, 0, tiled=True)
        recv_offsets = jnp.cumsum(recv_sizes) - recv_sizes
        out_offsets = jax.lax.all_to_all(recv_offsets, EXPERT, 0, 0, tiled=True)
        rows = jnp.take(jnp.repeat(x_l, k, axis=0), order, axis=0)
        ids = jnp.take(eid % num_local, order)
        buf = ep * a
        recv_x = ragged_all_to_all(
            rows,
            jnp.zeros((buf, x.shape[1]), x.dtype),
            in_offsets,
            send_sizes,
            out_offsets,
            recv_sizes,
            axis_name=EXPERT,
        )
        recv_e = ragged_all_to_all(
            ids,
            jnp.full((buf,), num_local, jnp.int32),
            in_offsets,
            send_sizes,
            out_offsets,
            recv_sizes,
            axis_name=EXPERT,
        )
    ys = _grouped_ffn(recv_x, recv_e, p, cfg.activation)
    with jax.named_scope("combine"):
        # The way back: I send each source its rows (at recv_offsets) to where it took them from.
        src_offsets = jax.lax.all_to_all(in_offsets, EXPERT, 0, 0, tiled=True)
        back = ragged_all_to_all(
            ys,
            jnp.zeros((a, ys.shape[1]), ys.dtype),
            recv_offsets,
            recv_sizes,
            src_offsets,
            send_sizes,
            axis_name=EXPERT,
        )
        got = jnp.zeros_like(back).at[order].set(back, unique_indices=True)
        got = jnp.where((eid < cfg.num_experts)[:, None], got, 0)
        out_l = jnp.einsum("tke,tk->te", got.reshape(t_l, k, -1), r.weights.astype(got.dtype))
        return _place_local(out_l, t, start)


def ragged_all_to_all(*args, **kwargs):
    """`jax.lax.ragged_all_to_all` (a module-level hook so CPU tests can emulate it)."""
    return jax.lax.ragged_all_to_all(*args, **kwargs)

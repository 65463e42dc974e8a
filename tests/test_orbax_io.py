"""save_params / restore_params on small dataclass params trees.

The cross-topology test saves here (single CPU device) and restores in a subprocess that has
8 virtual CPU devices, since XLA_FLAGS must be set before JAX is imported.
"""

import dataclasses
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import flax.struct
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from checkpoints.errors import CheckpointError
from checkpoints.orbax_io import restore_params, save_params
from checkpoints.orbax_layout import is_orbax_checkpoint

REPO_ROOT = Path(__file__).resolve().parents[1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Layer:
    w: jax.Array  # f32[d, d]
    b: jax.Array  # f32[d]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Params:
    embed: jax.Array  # f32[vocab, d]
    layers: tuple[Layer, ...]


@flax.struct.dataclass
class FlaxLayer:
    w: jax.Array  # f32[d, d]
    b: jax.Array  # f32[d]


@flax.struct.dataclass
class FlaxParams:
    embed: jax.Array  # f32[vocab, d]
    layers: tuple[FlaxLayer, ...]


FAMILIES = {"register_dataclass": (Params, Layer), "flax_struct": (FlaxParams, FlaxLayer)}


def make_params(family: str = "register_dataclass", num_layers: int = 2, d: int = 8):
    params_cls, layer_cls = FAMILIES[family]
    rng = np.random.default_rng(0)

    def arr(*shape):
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32))

    layers = tuple(layer_cls(w=arr(d, d), b=arr(d)) for _ in range(num_layers))
    return params_cls(embed=arr(16, d), layers=layers)


def abstract(tree, dtype=None):
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, dtype or x.dtype, sharding=x.sharding), tree
    )


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_round_trip_dataclass_tree(tmp_path, family):
    params = make_params(family)
    tokenizer = b"\x00\x01binary tokenizer"
    save_params(
        tmp_path,
        params,
        extra_files={"config.json": json.dumps({"hidden_size": 8}), "tokenizer.model": tokenizer},
    )
    assert is_orbax_checkpoint(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text()) == {"hidden_size": 8}
    assert (tmp_path / "tokenizer.model").read_bytes() == tokenizer

    target = abstract(params)
    restored = restore_params(tmp_path, target)
    assert type(restored) is type(params)
    assert type(restored.layers) is tuple
    assert_trees_equal(restored, params)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(target)):
        assert isinstance(got, jax.Array)
        assert got.sharding == want.sharding


def test_restore_into_arrays_and_numpy(tmp_path):
    params = make_params()
    save_params(tmp_path, params)
    like_arrays = jax.tree.map(jnp.zeros_like, params)
    assert_trees_equal(restore_params(tmp_path, like_arrays), params)
    like_numpy = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), params)
    restored = restore_params(tmp_path, like_numpy)
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(restored))
    assert_trees_equal(restored, params)


def test_save_numpy_leaves(tmp_path):
    params = {"a": np.arange(6, dtype=np.int32).reshape(2, 3), "b": np.ones(4, ml_dtypes.bfloat16)}
    save_params(tmp_path, params)
    restored = restore_params(tmp_path, jax.tree.map(jnp.asarray, params))
    assert_trees_equal(restored, params)


def test_float_to_bf16_is_cast(tmp_path):
    params = make_params()
    save_params(tmp_path, params)
    restored = restore_params(tmp_path, abstract(params, dtype=jnp.bfloat16))
    assert_trees_equal(restored, jax.tree.map(lambda x: x.astype(jnp.bfloat16), params))


def test_float_to_int_is_refused(tmp_path):
    params = make_params()
    save_params(tmp_path, params)
    target = abstract(params)
    target = dataclasses.replace(
        target, embed=jax.ShapeDtypeStruct((16, 8), jnp.int32, sharding=target.embed.sharding)
    )
    with pytest.raises(CheckpointError, match=r"leaf embed: checkpoint dtype float32.*int32"):
        restore_params(tmp_path, target)


def test_missing_leaf_named(tmp_path):
    save_params(tmp_path, make_params(num_layers=2))
    with pytest.raises(
        CheckpointError, match=r"missing from the checkpoint: layers\.2\.w, layers\.2\.b"
    ):
        restore_params(tmp_path, abstract(make_params(num_layers=3)))


def test_unexpected_leaf_named(tmp_path):
    save_params(tmp_path, make_params(num_layers=2))
    with pytest.raises(CheckpointError, match=r"target does not have: layers\.1\.b, layers\.1\.w"):
        restore_params(tmp_path, abstract(make_params(num_layers=1)))


def test_shape_mismatch_named(tmp_path):
    save_params(tmp_path, make_params(d=8))
    target = abstract(make_params(d=8))
    bad_layer = dataclasses.replace(
        target.layers[1],
        w=jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=target.embed.sharding),
    )
    target = dataclasses.replace(target, layers=(target.layers[0], bad_layer))
    with pytest.raises(
        CheckpointError,
        match=r"leaf layers\.1\.w: checkpoint shape \(8, 8\) != target shape \(8, 4\)",
    ):
        restore_params(tmp_path, target)


def test_target_without_sharding_refused(tmp_path):
    params = make_params()
    save_params(tmp_path, params)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    with pytest.raises(
        CheckpointError, match="leaf embed is a ShapeDtypeStruct without a sharding"
    ):
        restore_params(tmp_path, target)


def test_missing_checkpoint_dir(tmp_path):
    with pytest.raises(CheckpointError, match="no params checkpoint"):
        restore_params(tmp_path / "nowhere", abstract(make_params()))
    (tmp_path / "params").mkdir()
    assert not is_orbax_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="not a finished Orbax checkpoint"):
        restore_params(tmp_path, abstract(make_params()))


def test_overwrite_guard(tmp_path):
    save_params(tmp_path, make_params())
    with pytest.raises(CheckpointError, match="already exists"):
        save_params(tmp_path, make_params())
    replacement = jax.tree.map(lambda x: x + 1, make_params())
    save_params(tmp_path, replacement, overwrite=True)
    assert_trees_equal(restore_params(tmp_path, abstract(replacement)), replacement)


def test_bad_save_inputs(tmp_path):
    with pytest.raises(CheckpointError, match="leaf scale is a float"):
        save_params(tmp_path, {"w": np.ones(2), "scale": 0.5})
    with pytest.raises(CheckpointError, match="extra file name"):
        save_params(tmp_path, make_params(), extra_files={"../config.json": "{}"})
    assert not (tmp_path / "params").exists()


def test_orbax_info_logs_silenced(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    params = make_params()
    save_params(tmp_path, params)
    restore_params(tmp_path, abstract(params))
    chatter = [r for r in caplog.records if f"{os.sep}orbax{os.sep}" in r.pathname]
    assert not chatter, chatter[0].getMessage()


RESTORE_ON_MESH = textwrap.dedent(
    """
    import dataclasses, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from checkpoints.orbax_io import restore_params

    assert jax.device_count() == 8, jax.devices()

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass
    class Layer:
        w: jax.Array
        b: jax.Array

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass
    class Params:
        embed: jax.Array
        layers: tuple

    ckpt_dir, expected_file = sys.argv[1], sys.argv[2]
    expected = np.load(expected_file)
    mesh = jax.make_mesh((4, 2), ("data", "tensor"))
    specs = {"embed": P("data", "tensor"), "w": P(None, "tensor"), "b": P("data")}

    def target(dtype):
        def leaf(key, shape):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, specs[key]))
        layers = tuple(
            Layer(w=leaf("w", expected[f"layers.{i}.w"].shape),
                  b=leaf("b", expected[f"layers.{i}.b"].shape))
            for i in range(2)
        )
        return Params(embed=leaf("embed", expected["embed"].shape), layers=layers)

    def by_name(tree):
        flat = jax.tree_util.tree_flatten_with_path(tree)[0]
        return {jax.tree_util.keystr(p, simple=True, separator="."): x for p, x in flat}

    for dtype in (jnp.float32, jnp.bfloat16):
        tgt = target(dtype)
        restored = restore_params(ckpt_dir, tgt)
        assert type(restored) is Params and type(restored.layers[1]) is Layer
        got_leaves, want_leaves = by_name(restored), by_name(tgt)
        assert sorted(got_leaves) == sorted(expected.files)
        for name, got in got_leaves.items():
            want = want_leaves[name]
            assert got.sharding == want.sharding, (name, got.sharding, want.sharding)
            assert got.dtype == dtype, (name, got.dtype)
            assert len(got.addressable_shards) == 8, name
            for shard in got.addressable_shards:
                assert shard.data.shape == want.sharding.shard_shape(want.shape), name
            np.testing.assert_array_equal(
                np.asarray(got), expected[name].astype(dtype), err_msg=name
            )
    print("RESTORED_ON_MESH_OK")
    """
)


def test_restore_into_mesh_shardings(tmp_path):
    params = make_params()
    save_params(tmp_path / "ckpt", params)
    flat = {
        jax.tree_util.keystr(path, simple=True, separator="."): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    np.savez(tmp_path / "expected.npz", **flat)

    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            RESTORE_ON_MESH,
            str(tmp_path / "ckpt"),
            str(tmp_path / "expected.npz"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "RESTORED_ON_MESH_OK" in result.stdout

"""Verification of proposed tokens against the target model's own samples.

A proposer here is deterministic given the tokens so far (n-gram lookup; a draft model run
greedily): its distribution q is a point mass on the draft token d. The standard speculative
rejection rule (Leviathan et al. 2023; Chen et al. 2023) then reads: accept d with probability
min(1, p(d) / q(d)) = p(d); on rejection draw from the residual max(p - q, 0), i.e. p with d
removed and renormalised. Drawing t ~ p and accepting iff t == d has exactly that law:
P(t = d) = p(d), and given t != d, t ~ p(. | not d). So the runner samples every verified
position with the ordinary sampler (penalties, temperature, top-k / top-p / min-p, min_tokens
suppression, the row's seed at that position) and:

1. `accept` counts the leading positions whose target sample equals the draft;
2. the request emits those drafts plus the target sample at the first disagreeing position (or
   the bonus token after the last draft when all agree): 1 to K + 1 tokens per step.

Because each position's randomness is keyed by (seed, position), a seeded request emits the same
tokens with and without speculation (greedy ones trivially), up to float noise in the logits.
"""

from __future__ import annotations

from collections.abc import Sequence


def accept(drafts: Sequence[int], targets: Sequence[int]) -> tuple[list[int], int]:
    """(emitted tokens, number of drafts accepted) for one request.

    Args:
      drafts: the K proposed tokens (positions p+1 .. p+K).
      targets: the target model's K + 1 samples at positions p+1 .. p+K+1 (the last one is the
        bonus token, sampled after the last draft).
    """
    if len(targets) != len(drafts) + 1:
        raise ValueError(
            f"{len(drafts)} drafts need {len(drafts) + 1} target samples, got {len(targets)}"
        )
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return list(drafts[:a]) + [targets[a]], a

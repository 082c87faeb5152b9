"""Greedy token lists of two GPU paths that must agree up to near-ties of the precise reference."""

from localllm.engine.generator import Generator


def assert_same_or_near_tie(path, prompts, a_outs, b_outs, tie: float = 0.05) -> None:
    """Two paths that sum in different orders may part at a near-tie only: where a prompt's
    tokens first differ, the precise CPU reference must score both choices within `tie`."""
    if a_outs == b_outs:
        return
    gen = Generator.load(str(path), precise=True)
    try:
        for p, a, b in zip(prompts, a_outs, b_outs, strict=True):
            i = next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
            if i is not None:
                logits = gen.score(list(p) + a[:i])[-1]
                assert abs((logits[a[i]] - logits[b[i]]).item()) < tie, f"step {i}: not a tie"
    finally:
        gen.close()

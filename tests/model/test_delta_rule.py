"""The chunked (WY) gated delta rule and rollback's state rebuild against the sequential
recurrence in float64 NumPy."""
import mlx.core as mx
import numpy as np
import pytest

from mtp_engine.model.delta_rule import delta_rule_chunked, delta_rule_step, state_after


def sequential(q, k, v, g, beta, s0):
    """Reference: the recurrence token by token; returns outputs, every intermediate state."""
    b, s, h, kd = k.shape
    state = s0.astype(np.float64).copy()
    outs, states = [], [state.copy()]
    for t in range(s):
        state = state * np.exp(g[:, t])[:, :, None, None]
        u = (v[:, t] - np.einsum("bhkv,bhk->bhv", state, k[:, t])) * beta[:, t][:, :, None]
        state = state + np.einsum("bhk,bhv->bhkv", k[:, t], u)
        outs.append(np.einsum("bhkv,bhk->bhv", state, q[:, t]))
        states.append(state.copy())
    return np.stack(outs, axis=1), states


def inputs(rng, s, h=3, kd=8, vd=6, same_keys=False, strong=False):
    k = rng.standard_normal((1, s, h, kd))
    if same_keys:
        k[:] = k[:, :1]
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    q = rng.standard_normal((1, s, h, kd)) / np.sqrt(kd)
    v = rng.standard_normal((1, s, h, vd))
    g = -rng.uniform(0.0, 3.0 if strong else 0.3, (1, s, h))
    beta = rng.uniform(0.9 if same_keys else 0.0, 1.0, (1, s, h))
    s0 = rng.standard_normal((1, h, kd, vd))
    return q, k, v, g, beta, s0


@pytest.mark.parametrize("s,chunk,kind", [(2, 32, "random"), (5, 32, "random"), (9, 4, "random"),
                                          (70, 32, "random"), (64, 64, "same_keys"), (40, 16, "strong")])
def test_chunked_matches_sequential(s, chunk, kind):
    rng = np.random.default_rng(s * 31 + chunk)
    arrs = inputs(rng, s, same_keys=kind == "same_keys", strong=kind == "strong")
    ref_o, ref_states = sequential(*arrs)
    o, state, u = delta_rule_chunked(*(mx.array(a.astype(np.float32)) for a in arrs), chunk=chunk)
    scale = np.abs(ref_o).max()
    np.testing.assert_allclose(np.array(o), ref_o, atol=2e-5 * max(scale, 1.0) * np.sqrt(s))
    np.testing.assert_allclose(np.array(state), ref_states[-1], atol=1e-4 * max(np.abs(ref_states[-1]).max(), 1))
    # rollback: the state after any prefix, from (state0, k, u, g)
    q, k, v, g, beta, s0 = (mx.array(a.astype(np.float32)) for a in arrs)
    for n in sorted({0, 1, s // 2, s - 1, s}):
        np.testing.assert_allclose(np.array(state_after(s0, k, u, g, n)), ref_states[n],
                                   atol=1e-4 * max(np.abs(ref_states[n]).max(), 1), err_msg=f"n={n}")


def test_step_matches_sequential_and_chunked_of_one():
    rng = np.random.default_rng(0)
    arrs = inputs(rng, 1)
    ref_o, ref_states = sequential(*arrs)
    q, k, v, g, beta, s0 = (mx.array(a.astype(np.float32)) for a in arrs)
    state, o, u = delta_rule_step(s0, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])
    np.testing.assert_allclose(np.array(o), ref_o[:, 0], atol=1e-5)
    np.testing.assert_allclose(np.array(state), ref_states[1], atol=1e-5)
    np.testing.assert_allclose(np.array(state_after(s0, k, u[:, None], g, 1)), ref_states[1], atol=1e-5)


def test_the_mixer_with_unfused_steps_is_the_mixer():
    # the CUDA kernel's self-test compares against gdn.mix(fused_steps=False): it must be the same
    # computation as the fused steps the engine's MLX path runs (captured and not)
    from mtp_engine.model import gdn
    from mtp_engine.model import kernels
    d = gdn.Dims(2, 16, 4, 8, 4, 1e-6)
    for s, capture in ((1, False), (5, True), (3, False)):
        x = kernels.gdn.random_inputs(d, s, seed=s, batch=2)
        a = gdn.mix(d, **x, capture=capture)
        b = gdn.mix(d, **x, capture=capture, fused_steps=False)
        for u, w in zip(a, b):
            np.testing.assert_allclose(np.array(u), np.array(w), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("s,valid", [(9, [9, 3, 6, 1]), (16, [2, 16, 11]), (40, [40, 17, 33])],
                         ids=["steps", "steps-16", "chunked"])
def test_rows_of_their_own_lengths_end_as_each_alone(s, valid):
    # prompts of several lengths read in one pass (`gdn.mix`'s `valid`, a batch's joint read):
    # each row's outputs, state and conv window are bit for bit those of its own tokens alone, in the
    # token steps (up to 16 tokens) and in the chunked form; the padded tokens are junk on purpose
    from mtp_engine.model import gdn
    from mtp_engine.model import kernels
    d = gdn.Dims(2, 16, 4, 8, 4, 1e-6)
    x = kernels.gdn.random_inputs(d, s, seed=s, batch=len(valid))
    together = gdn.mix(d, **x, valid=mx.array(valid, mx.int32))
    per_token = ("qkv_x", "z_x", "alpha_x", "beta_x")
    per_row = per_token + ("conv0", "state0")
    for b, n in enumerate(valid):
        row = {k: (v[b:b + 1, :n] if k in per_token else v[b:b + 1]) if k in per_row else v for k, v in x.items()}
        alone = gdn.mix(d, **row)
        assert np.array_equal(np.array(together.y[b:b + 1, :n]), np.array(alone.y)), b
        assert np.array_equal(np.array(together.state[b:b + 1]), np.array(alone.state)), b
        assert np.array_equal(np.array(together.conv[b:b + 1]), np.array(alone.conv)), b

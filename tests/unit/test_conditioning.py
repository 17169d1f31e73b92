"""Conditioning as data (take/concat keep every field aligned with the rows), classifier-free
guidance inside the expert as a plain velocity (known answers with constant velocities), and
the sampling loop's stages for a text DDM: Encode first, Route/Velocity per step, Decode last;
label-only routing refused where the partition is not by label."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ddm.conditioning import (LABELS, TEXT, Conditioning, EncodedPrompts, concat, guided_rows,
                              row_keys)
from ddm.convention import TimeGrid, flow_match_sigma_grid
from ddm.sampling.guidance import guided
from ddm.sampling.loop import (Calls, Decode, Decoded, Encode, Mixture, Route, SamplingRequest,
                               StepEvent, Velocity, check_request, denoise, row_steps)
from ddm.sampling.routing import parse_strategy


def text(values, length: int = 3, width: int = 2, **fields) -> Conditioning:
    """Rows whose embeddings are all ``values[i]``, with a mask."""
    values = np.asarray(values, np.float32)
    embeddings = np.broadcast_to(values[:, None, None], (len(values), length, width)).copy()
    mask = np.ones((len(values), length), np.int64)
    return Conditioning(embeddings=embeddings, mask=mask, **fields)


# ------------------------------------------------------------------------- take and concat


def test_take_keeps_labels_aligned_with_the_rows_repeats_included():
    cond = Conditioning.from_labels([7, 8, 9])
    assert cond.kind == LABELS and len(cond) == 3
    assert cond.take([2, 0, 0]).labels.tolist() == [9, 7, 7]


def test_take_keeps_every_text_field_and_the_negative_aligned():
    cond = text([1, 2, 3], pooled=np.arange(6, dtype=np.float32).reshape(3, 2)).with_guidance(
        np.array([1.0, 4.0, 7.5]), negative=text([10, 20, 30]))
    picked = cond.take([2, 1])
    assert picked.kind == TEXT and len(picked) == 2
    assert picked.embeddings[:, 0, 0].tolist() == [3, 2]
    assert picked.pooled.tolist() == [[4, 5], [2, 3]]
    assert picked.guidance.tolist() == [7.5, 4.0]
    assert picked.negative.embeddings[:, 0, 0].tolist() == [30, 20]
    assert picked.mask.shape == (2, 3)


def test_concat_joins_rows_in_order_and_round_trips_take():
    cond = text([1, 2, 3, 4]).with_guidance(2.0, negative=text([5, 6, 7, 8]))
    joined = concat([cond.take([0, 1]), cond.take([2, 3])])
    for name in ("embeddings", "mask", "guidance"):
        np.testing.assert_array_equal(getattr(joined, name), getattr(cond, name))
    np.testing.assert_array_equal(joined.negative.embeddings, cond.negative.embeddings)
    assert concat([Conditioning.from_labels([1]), Conditioning.from_labels([2, 3])]
                  ).labels.tolist() == [1, 2, 3]


@pytest.mark.parametrize("parts, message", [
    ([], "nothing to concatenate"),
    ([Conditioning.from_labels([1]), text([1])], "label and text"),
    ([text([1]), text([1], length=4)], r"different \(L, D\)"),
    ([text([1]), text([1], pooled=np.zeros((1, 2), np.float32))], "with and without pooled"),
    ([text([1]).with_guidance(2.0), text([1]).with_guidance(2.0, text([0]))],
     "with and without a negative"),
])
def test_concat_refuses_rows_that_do_not_go_together(parts, message):
    with pytest.raises(ValueError, match=message):
        concat(parts)


def test_a_missing_mask_or_guidance_is_filled_with_its_neutral_value():
    """None means every token counts / scale 1: precomputed embeddings without a mask stack
    with an encoder's masked null rows."""
    bare = Conditioning(embeddings=np.zeros((1, 3, 2), np.float32))
    masked = text([1.0]).with_guidance(7.5)
    masked = Conditioning(embeddings=masked.embeddings, mask=np.array([[1, 1, 0]]),
                          guidance=masked.guidance)
    joined = concat([bare, masked])
    assert joined.mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert joined.guidance.tolist() == [1.0, 7.5]


def test_concat_shares_rows_that_already_follow_each_other_in_one_array():
    rows = np.arange(4 * 3 * 2, dtype=np.float32).reshape(4, 3, 2)
    first, second = Conditioning(embeddings=rows[:2]), Conditioning(embeddings=rows[2:])
    joined = concat([first, second])
    assert np.shares_memory(joined.embeddings, rows) and joined.embeddings.shape == (4, 3, 2)
    assert (joined.embeddings == rows).all()
    for parts, order in (([second, first], [2, 3, 0, 1]),  # out of order
                         ([Conditioning(embeddings=rows[:1]), second], [0, 2, 3]),  # a gap
                         ([first, Conditioning(embeddings=rows[2:].copy())], [0, 1, 2, 3])):
        copied = concat(parts)
        assert not np.shares_memory(copied.embeddings, rows)
        assert (copied.embeddings == rows[order]).all()


def test_row_keys_name_rows_by_content_and_ride_through_take_and_guidance():
    cond = text([1.0, 2.0, 1.0], negative=text([0.0, 0.0, 5.0]))
    keyed = cond.keyed()
    assert (keyed.keys == row_keys(cond)).all() and keyed.keys.shape == (3, 32)
    assert (keyed.keys[0] == keyed.keys[2]).all() and not (keyed.keys[0] == keyed.keys[1]).all()
    assert (keyed.negative.keys == row_keys(cond.negative)).all()
    taken = keyed.take([2, 1]).with_guidance(2.0, keyed.negative.take([2, 1]))
    assert (taken.keys == row_keys(cond.take([2, 1]))).all()
    assert (taken.negative.keys == row_keys(cond.negative.take([2, 1]))).all()
    masked = dataclasses.replace(cond, mask=np.array([[1, 1, 0]] * 3))
    assert not (row_keys(masked) == keyed.keys).all(axis=1).any()
    assert concat([keyed.take([0]), cond.take([1])]).keys is None  # made again where needed
    assert not keyed.embeddings.flags.writeable and cond.embeddings.flags.writeable
    whole = keyed.take([0, 1, 2])  # keyed rows taken whole are shared, others copied
    assert whole.embeddings is keyed.embeddings and whole.negative.keys is keyed.negative.keys
    assert not np.shares_memory(keyed.take([1, 0, 2]).embeddings, keyed.embeddings)
    assert not np.shares_memory(cond.take([0, 1, 2]).embeddings, cond.embeddings)
    assert (concat([keyed.take([0]), keyed.take([1])]).keys == keyed.keys[:2]).all()


def test_guided_keyed_rows_taken_whole_are_the_conditioning_itself():
    keyed = text([1.0, 2.0]).keyed()
    with_scales = keyed.with_guidance(np.array([2.0, 3.0]), text([0.0, 0.0]).keyed())
    assert not with_scales.guidance.flags.writeable  # nobody writes a row's scale
    assert with_scales.take([0, 1]) is with_scales  # nothing to copy: no new object
    assert with_scales.take(np.arange(2)) is with_scales
    reordered = with_scales.take([1, 0])
    assert reordered is not with_scales and reordered.guidance.tolist() == [3.0, 2.0]
    assert reordered.negative.embeddings[:, 0, 0].tolist() == [0.0, 0.0]
    unkeyed = text([1.0, 2.0]).with_guidance(2.0)
    assert unkeyed.take([0, 1]) is not unkeyed  # its writable rows are copied
    assert not np.shares_memory(unkeyed.take([0, 1]).embeddings, unkeyed.embeddings)


def test_bad_conditioning_is_refused_by_name():
    with pytest.raises(ValueError, match="exactly one"):
        Conditioning()
    with pytest.raises(ValueError, match="exactly one"):
        Conditioning(labels=np.zeros(1, np.int64), embeddings=np.zeros((1, 2, 2), np.float32))
    with pytest.raises(ValueError, match=r"shape \(B, L, D\)"):
        Conditioning(embeddings=np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="mask shape"):
        Conditioning(embeddings=np.zeros((2, 3, 4), np.float32), mask=np.ones((2, 4), np.int64))
    with pytest.raises(ValueError, match="guidance has"):
        text([1, 2], guidance=np.ones(3, np.float32))
    with pytest.raises(ValueError, match="needs text conditioning"):
        Conditioning.from_labels([1]).with_guidance(7.5)
    with pytest.raises(IndexError, match="outside"):
        text([1, 2]).take([2])


# --------------------------------------------------------------------------------- guidance


class ConstantNetwork:
    """Velocity = each row's embedding value, so the conditional rows give ``c`` and the null
    (or negative) rows ``u``; records the rows of every forward pass."""

    def __init__(self) -> None:
        self.batches: list[int] = []

    def __call__(self, x, t, cond: Conditioning) -> np.ndarray:
        assert cond.guidance is None and cond.negative is None, "the network sees plain rows"
        assert len(x) == len(t) == len(cond)
        self.batches.append(len(x))
        return np.broadcast_to(cond.embeddings[:, 0, 0, None, None, None], x.shape).copy()


NULL = text([1.0])


@pytest.mark.parametrize("scale", [0.0, 2.0, 7.5])
def test_guided_velocity_is_u_plus_s_times_c_minus_u_in_one_forward(scale):
    network = ConstantNetwork()
    v = guided(network, NULL)(np.zeros((2, 1, 2, 2), np.float32), np.zeros(2, np.float32),
                             text([3.0, 5.0]).with_guidance(scale))
    np.testing.assert_allclose(v[0], 1 + scale * (3 - 1))
    np.testing.assert_allclose(v[1], 1 + scale * (5 - 1))
    assert network.batches == [4]  # conditional and unconditional rows stacked, one call


def test_rows_with_scale_1_skip_the_unconditional_half():
    network = ConstantNetwork()
    v = guided(network, NULL)(np.zeros((3, 1, 1, 1), np.float32), np.zeros(3, np.float32),
                             text([3.0, 5.0, 7.0]).with_guidance(np.array([1.0, 2.0, 1.0])))
    np.testing.assert_allclose(v.reshape(-1), [3.0, 1 + 2 * (5 - 1), 7.0])
    assert network.batches == [4]  # 3 conditional rows + 1 unconditional
    unguided = guided(network, NULL)(np.zeros((2, 1, 1, 1), np.float32),
                                     np.zeros(2, np.float32), text([3.0, 5.0]).with_guidance(1))
    np.testing.assert_allclose(unguided.reshape(-1), [3.0, 5.0])
    assert network.batches[-1] == 2


def test_a_negative_conditioning_replaces_the_null_one():
    v = guided(ConstantNetwork(), NULL)(
        np.zeros((2, 1, 1, 1), np.float32), np.zeros(2, np.float32),
        text([3.0, 5.0]).with_guidance(2.0, negative=text([0.0, -1.0])))
    np.testing.assert_allclose(v.reshape(-1), [0 + 2 * (3 - 0), -1 + 2 * (5 + 1)])


def test_the_null_conditioning_is_one_row_of_text():
    with pytest.raises(ValueError, match="one unguided row"):
        guided(ConstantNetwork(), text([1.0, 2.0]))
    with pytest.raises(ValueError, match="one unguided row"):
        guided(ConstantNetwork(), Conditioning.from_labels([0]))


# ------------------------------------------------------------- the loop's stages, sans I/O

TEXT_DDM = Mixture(expert_names=("a", "b"), expert_classes=((), ()), image_shape=(1, 2, 2),
                   num_classes=0, routed=True, conditioning=TEXT, encoder=True, decoder=True,
                   grid=TimeGrid("flow-match"))
LABEL_DDM = Mixture(expert_names=("a", "b"), expert_classes=((0,), (1,)), image_shape=(1, 2, 2),
                    num_classes=2, routed=True)


def text_request(**fields) -> SamplingRequest:
    return SamplingRequest(**{"labels": (), "steps": 3, "seed": 0,
                              "strategy": parse_strategy("top2"), "prompts": ("a", "b"),
                              "guidance_scale": 7.5, **fields})


def drive(mixture: Mixture, request: SamplingRequest, velocity: float = 1.0):
    """Answer the loop's queries with constants; every query and event in order."""
    loop, answer, seen = denoise(mixture, request), None, []
    while True:
        try:
            item = loop.send(answer)
        except StopIteration:
            return seen
        seen.append(item)
        if isinstance(item, Encode):
            answer = text(np.arange(len(item.prompts), dtype=np.float32) + 2)
        elif isinstance(item, Route):
            answer = np.tile([0.75, 0.25], (len(item.x), 1))
        elif isinstance(item, Calls):
            answer = [np.full_like(c.x, velocity) for c in item.calls]
        elif isinstance(item, Decode):
            answer = np.clip(item.latents[:, [0, 0, 0]], -1, 1)
        else:
            answer = None


def test_a_text_ddm_encodes_first_routes_and_guides_per_step_and_decodes_last():
    seen = drive(TEXT_DDM, text_request(negative_prompt="blurry"))
    assert isinstance(seen[0], Encode) and seen[0].prompts == ("a", "b", "blurry")
    assert isinstance(seen[-2], Decode) and isinstance(seen[-1], Decoded)
    velocities = [c for q in seen if isinstance(q, Calls) for c in q.calls]
    assert len(velocities) == 3 * 2  # top2 of two experts, three steps
    for call in velocities:
        assert isinstance(call, Velocity)
        assert call.cond.guidance.tolist() == [7.5, 7.5]
        assert call.cond.embeddings[:, 0, 0].tolist() == [2, 3]  # the prompts' rows
        assert call.cond.negative.embeddings[:, 0, 0].tolist() == [4, 4]  # "blurry" per row
    # Velocity 1 on FlowMatchEulerDiscrete's grid: x moves by exactly t_end - t_start = 1.
    events = [e for e in seen if isinstance(e, StepEvent)]
    np.testing.assert_allclose(events[0].probs, [[0.75, 0.25]] * 2)  # the router's, per row
    start = drive(TEXT_DDM, text_request(output="latent"), velocity=0.0)[-1].x
    np.testing.assert_allclose(events[-1].x, start + 1.0, atol=1e-6)
    assert [e.t for e in events] == pytest.approx(flow_match_sigma_grid(3).times[1:].tolist())
    assert seen[-1].images.shape == (2, 2, 2, 3) and seen[-1].images.dtype == np.uint8


def test_precomputed_embeddings_and_latent_output_need_no_text_model_or_decoder():
    seen = drive(TEXT_DDM, text_request(prompts=(), conditioning=text([3.0]), output="latent"))
    assert not any(isinstance(q, (Encode, Decode, Decoded)) for q in seen)
    assert isinstance(seen[-1], StepEvent) and seen[-1].x.shape == (1, 1, 2, 2)


def test_the_guidance_cut_off_unguides_the_later_steps():
    seen = drive(TEXT_DDM, text_request(steps=4, guidance_cutoff=0.5))
    scales = [q.calls[0].cond.guidance.tolist() for q in seen if isinstance(q, Calls)]
    assert scales == [[7.5, 7.5]] * 2 + [[1.0, 1.0]] * 2


def test_a_request_costs_a_row_per_image_and_step_and_a_second_at_each_guided_step():
    """What a client's budget is charged: guided rows run twice, for the guided steps only."""
    assert row_steps(text_request(steps=4, guidance_scale=1.0)) == 2 * 4
    assert row_steps(text_request(steps=4)) == 2 * (4 + 4)  # 7.5, every step guided
    assert row_steps(text_request(steps=4, guidance_cutoff=0.5)) == 2 * (4 + 2)
    assert row_steps(SamplingRequest(labels=(1, 2, 3), steps=5, seed=0,
                                     strategy=parse_strategy("oracle"))) == 3 * 5


def test_given_latents_are_the_initial_state():
    latents = np.full((2, 1, 2, 2), 0.5, np.float32)
    seen = drive(TEXT_DDM, text_request(latents=latents, output="latent"), velocity=0.0)
    np.testing.assert_array_equal(seen[-1].x, latents)


@pytest.mark.parametrize("strategy", ["oracle"])
def test_label_only_routing_refuses_a_text_ddm_by_name(strategy):
    with pytest.raises(ValueError, match="oracle strategy routes by label.*conditioned on text"):
        check_request(TEXT_DDM, text_request(strategy=parse_strategy(strategy)))


@pytest.mark.parametrize("fields, message", [
    ({"labels": (0,)}, "conditioned on text: send prompts, not labels"),
    ({"prompts": ()}, "either prompts or precomputed conditioning"),
    ({"conditioning": text([1.0])}, "either prompts or precomputed conditioning"),
    ({"prompts": (), "conditioning": Conditioning.from_labels([0])}, "holds labels"),
    ({"guidance_scale": -1.0}, r"guidance_scale must be a number in \[0, 50\]"),
    ({"guidance_scale": float("nan")}, "guidance_scale"),
    ({"guidance_cutoff": 2.0}, "guidance_cutoff"),
    ({"output": "png"}, "output must be one of image, latent"),
    ({"latents": np.zeros((2, 1, 2, 2), np.float64)}, "latents must be float32"),
    ({"latents": np.full((2, 1, 2, 2), np.nan, np.float32)}, "NaN"),
    ({"latents": np.full((2, 1, 2, 2), -10000.5, np.float32)},
     r"latents must lie within \+-10000 \(MAX_STATE_MAGNITUDE\), got a value of magnitude "
     r"1e\+04"),
])
def test_bad_text_requests_are_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        check_request(TEXT_DDM, text_request(**fields))


def test_a_text_ddm_without_an_encoder_takes_embeddings_only():
    no_encoder = dataclasses.replace(TEXT_DDM, encoder=False)
    with pytest.raises(ValueError, match="no text encoder"):
        check_request(no_encoder, text_request())


@pytest.mark.parametrize("fields, message", [
    ({"prompts": ("a cat",)}, "conditioned on labels; it takes no prompts"),
    ({"guidance_scale": 7.5}, "guidance_scale must be 1 for a label DDM"),
    ({"negative_prompt": "x"}, "takes no negative_prompt"),
])
def test_a_label_ddm_refuses_prompts_and_guidance(fields, message):
    request = SamplingRequest(labels=(0, 1), steps=2, seed=0, strategy=parse_strategy("top1"),
                              **fields)
    with pytest.raises(ValueError, match=message):
        check_request(LABEL_DDM, request)


def test_a_label_ddm_still_routes_by_label_and_decodes_nothing():
    request = SamplingRequest(labels=(0, 1), steps=2, seed=0, strategy=parse_strategy("oracle"))
    seen = drive(LABEL_DDM, request)
    assert not any(isinstance(q, (Encode, Route, Decode, Decoded)) for q in seen)
    calls = [q for q in seen if isinstance(q, Calls)]
    assert [(c.expert, c.cond.labels.tolist()) for c in calls[0].calls] == [(0, [0]), (1, [1])]


def test_the_loop_walks_the_ddms_declared_grid_flow_match_with_shift_as_diffusers_sets_it():
    from diffusers import FlowMatchEulerDiscreteScheduler

    shifted = dataclasses.replace(TEXT_DDM, grid=TimeGrid("flow-match", shift=3.0))
    seen = drive(shifted, text_request(steps=5, output="latent"))
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    scheduler.set_timesteps(5)
    expected = 1.0 - scheduler.sigmas.numpy()[1:]
    np.testing.assert_allclose([e.t for e in seen if isinstance(e, StepEvent)], expected,
                               atol=1e-7)
    routed_times = [float(q.t[0]) for q in seen if isinstance(q, Route)]
    np.testing.assert_allclose(routed_times, 1.0 - scheduler.sigmas.numpy()[:-1], atol=1e-7)


def test_an_encoders_answer_names_the_words_it_ignored_once_per_prompt():
    def answer(rows: int, cut: list[int], unknown: list[list[int]]) -> EncodedPrompts:
        return EncodedPrompts(Conditioning(embeddings=np.zeros((rows, 2, 3), np.float32),
                                           mask=np.ones((rows, 2), np.int64)),
                              np.array(cut, np.int64), np.array(unknown, np.int64).reshape(-1, 3))

    # split into two calls: the second part's rows follow the first's
    joined = EncodedPrompts.concat([answer(1, [0], [[0, 2, 8]]),
                                    answer(3, [0, 0, 2], [[0, 2, 5], [1, 2, 5]])])
    assert joined.unknown.tolist() == [[0, 2, 8], [1, 2, 5], [2, 2, 5]]
    prompts = ["a purple eight", "a cat", "a cat", "a red eight eight eight"]
    assert joined.warnings(prompts) == [
        "'a purple eight': the text encoder does not know purple; ignored",
        "'a cat': the text encoder does not know cat; ignored",
        "'a red eight eight eight': longer than the text encoder takes; its last 2 token(s) "
        "ignored"]
    with pytest.raises(ValueError, match=r"unknown words are \(N, 3\) spans, got \(2,\)"):
        EncodedPrompts(joined.cond, joined.tokens_cut, np.zeros(2, np.int64))


def test_with_scalesneed_negative_rows_one_rule_for_every_driver() -> None:
    """Which rows are guided, and the refusal of guided rows without negative rows, is one
    function: the in-process guidance (here), the router's pools and the expert servers
    (tests/integration/test_text_serving.py) call it."""
    scales = np.array([1.0, 4.0, 1.0], np.float32)
    np.testing.assert_array_equal(guided_rows(scales, 3, True, "the context"),
                                  [False, True, False])
    assert not guided_rows(None, 3, False, "the context").any()
    assert not guided_rows(np.ones(3, np.float32), 3, False, "the context").any()
    with pytest.raises(ValueError, match="guided rows need the context's negative rows, and "
                                         "it has none"):
        guided_rows(scales, 3, False, "the context")
    unguidable = dataclasses.replace(text([1.0, 2.0, 3.0]), guidance=scales)
    with pytest.raises(ValueError, match="guided rows need the conditioning's negative rows"):
        guided(lambda x, t, cond: x, None)(np.zeros((3, 1, 2, 2), np.float32),
                                          np.zeros(3, np.float32), unguidable)

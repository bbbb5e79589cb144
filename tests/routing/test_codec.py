"""Engine routed-experts codec and alignment (trl_moe_replay.routing.codec).

Payloads follow vLLM 0.33's contract (research/vllm.md sections 1.3, 2, 8): per completion an array
``[p + c - 1 - s, L, K]`` (uint8 if <= 256 experts else uint16), row j = position s + j of
prompt+completion, the last token has no row, dense layers are zero rows; base64 of a ``.npy``.
"""

import base64
import io
import re

import numpy as np
import pytest
import torch

from trl_moe_replay.routing.codec import (
    decode_routed_experts,
    encode_routed_experts,
    engine_dtype,
    routes_from_engine,
)
from trl_moe_replay.routing.errors import RouteAlignmentError, RouteValidationError
from trl_moe_replay.routing.routes import has_route, route_dtype, validate_routes

from tests.helpers import no_route


L, K, E = 4, 2, 64


def route_value(position, layer, slot, num_experts=E):
    """Recognisable id for (position, layer, slot): adjacent positions, layers and slots all differ."""
    return (position * 31 + layer * 7 + slot * 3 + 1) % num_experts


def engine_rows(p, c, s=0, *, layers=L, top_k=K, num_experts=E, dense=(), dtype=None):
    """What vLLM returns for one completion: rows for positions s .. p + c - 2."""
    dtype = dtype or engine_dtype(num_experts)
    q = np.arange(s, p + c - 1)[:, None, None]
    layer = np.arange(layers)[None, :, None]
    slot = np.arange(top_k)[None, None, :]
    rows = ((q * 31 + layer * 7 + slot * 3 + 1) % num_experts).astype(dtype)
    rows[:, list(dense)] = 0  # vLLM never writes dense layers
    return rows


def reference(samples, prompt_width, completion_width, *, layers=L, top_k=K, num_experts=E, dense=()):
    """Per-token loop over TRL's columns, independent of the implementation under test."""
    out = torch.full((len(samples), prompt_width + completion_width, layers, top_k), -1, dtype=torch.int16)
    for b, (p, c, s, has_rows) in enumerate(samples):
        if not has_rows:
            continue
        for col in range(prompt_width + completion_width):
            if col < prompt_width:
                if col < prompt_width - p:
                    continue  # left pad
                q = col - (prompt_width - p)
            else:
                if col - prompt_width >= c:
                    continue  # right pad
                q = p + (col - prompt_width)
            if q < s or q == p + c - 1:
                continue  # skipped prefix / final token
            for layer in range(layers):
                if layer in dense:
                    continue
                for slot in range(top_k):
                    out[b, col, layer, slot] = route_value(q, layer, slot, num_experts)
    return out


def align(rows, samples, prompt_width, completion_width, **kwargs):
    kwargs.setdefault("num_layers", L)
    kwargs.setdefault("top_k", K)
    return routes_from_engine(
        rows,
        prompt_lengths=[p for p, _, _, _ in samples],
        completion_lengths=[c for _, c, _, _ in samples],
        prompt_starts=[s for _, _, s, _ in samples],
        prompt_width=prompt_width,
        completion_width=completion_width,
        **kwargs,
    )


def vllm_numpy2base64(array):
    """vLLM's vllm/utils/serial_utils.py::numpy2base64, with the stdlib codec."""
    with io.BytesIO() as buffer:
        np.save(buffer, array, allow_pickle=False)
        return base64.b64encode(buffer.getbuffer()).decode("ascii")


# ----------------------------------------------------------------------------- layout


def test_module_docstring_example_exactly():
    rows = np.arange(1, 5 * 2 * 2 + 1, dtype=np.uint8).reshape(5, 2, 2)  # r0..r4, all distinct
    out = routes_from_engine(
        [rows],
        prompt_lengths=[3],
        completion_lengths=[4],
        prompt_starts=[1],
        prompt_width=5,
        completion_width=6,
        num_layers=2,
        top_k=2,
    )
    assert out.dtype == torch.int16 and out.device.type == "cpu" and out.shape == (1, 11, 2, 2)
    #                  pad pad  P0  P1  P2 | C0  C1  C2  C3 pad pad
    assert out[0, :, 0, 0].tolist() == [-1, -1, -1, 1, 5, 9, 13, 17, -1, -1, -1]
    torch.testing.assert_close(out[0, 3:8], torch.from_numpy(rows.astype(np.int16)))


def test_mixed_batch_every_column_maps_to_its_token():
    samples = [  # (prompt, completion, prompt_start, has_rows)
        (6, 9, 0, True),  # full prompt and completion width
        (2, 1, 0, True),  # one completion token: only prompt rows
        (4, 5, 0, False),  # aborted / no routes
        (5, 3, 2, True),  # prompt_start > 0
        (1, 7, 0, True),  # one-token prompt
        (6, 4, 6, True),  # decode-only delta (s == p)
    ]
    rows = [engine_rows(p, c, s) if has else None for p, c, s, has in samples]
    out = align(rows, samples, prompt_width=6, completion_width=9)
    torch.testing.assert_close(out, reference(samples, 6, 9), rtol=0, atol=0)

    # Spot checks spelled out, so a shared mistake in the reference cannot hide.
    assert no_route(out[1, :4]).all()  # 4 left pads for a 2-token prompt
    assert out[1, 4, 0, 0] == route_value(0, 0, 0) and out[1, 5, 1, 1] == route_value(1, 1, 1)
    assert no_route(out[1, 6:]).all()  # the only completion token is final: no route
    assert out[0, 6, 2, 1] == route_value(6, 2, 1)  # first completion token = position p
    assert no_route(out[0, 14]).all() and out[0, 13, 3, 0] == route_value(13, 3, 0)
    assert no_route(out[2]).all()
    assert no_route(out[3, :3]).all() and out[3, 3, 0, 0] == route_value(2, 0, 0)
    assert no_route(out[5, :6]).all() and out[5, 6, 0, 0] == route_value(6, 0, 0) and no_route(out[5, 9]).all()


def test_prompt_start_skips_the_routed_prefix():
    p, c, s = 7, 3, 4
    rows = engine_rows(p, c, s)
    assert rows.shape[0] == p + c - 1 - s
    out = align([rows], [(p, c, s, True)], prompt_width=8, completion_width=3)
    assert no_route(out[0, : 8 - p + s]).all()  # left pad + the s skipped prompt tokens
    assert out[0, 8 - p + s, 0, 0] == route_value(s, 0, 0)
    torch.testing.assert_close(out, reference([(p, c, s, True)], 8, 3), rtol=0, atol=0)


def test_stop_string_trimming_rows_follow_returned_tokens():
    # vLLM generated 7 tokens; a stop string ended the text after token 4, so the output processor
    # drops the 3 surplus tokens AND their rows (routed_experts[:-num_dropped], vllm.md 1.2 step 5).
    p, generated, returned = 5, 7, 4
    full = engine_rows(p, generated)
    trimmed = full[: -(generated - returned)]
    assert trimmed.shape[0] == p + returned - 1

    out = align([trimmed], [(p, returned, 0, True)], prompt_width=5, completion_width=8)
    for k in range(returned - 1):  # returned completion tokens keep the engine's routes
        torch.testing.assert_close(out[0, 5 + k], torch.from_numpy(full[p + k].astype(np.int16)))
    assert no_route(out[0, 5 + returned - 1]).all()  # last returned token: its row went with the surplus
    assert no_route(out[0, 5 + returned :]).all()

    # The untrimmed array with the trimmed token count is a mismatch, never cut silently.
    with pytest.raises(
        RouteAlignmentError, match=r"sample 0: expected prompt 5 \+ completion 4 .* = 8 engine rows, got 11"
    ):
        align([full], [(p, returned, 0, True)], prompt_width=5, completion_width=8)


def test_empty_completion_expects_prompt_rows_minus_one():
    out = align([engine_rows(4, 0)], [(4, 0, 0, True)], prompt_width=4, completion_width=2)
    assert no_route(out[0, 3]).all() and out[0, 2, 1, 1] == route_value(2, 1, 1)
    assert no_route(out[0, 4:]).all()
    with pytest.raises(RouteAlignmentError, match="sample 0"):  # a row for the last prompt token is one too many
        align([engine_rows(4, 1)], [(4, 0, 0, True)], prompt_width=4, completion_width=2)


def test_dense_layers_become_minus_one():
    dense = (0, 2)
    samples = [(3, 4, 0, True), (2, 2, 1, True)]
    rows = [engine_rows(p, c, s, dense=dense) for p, c, s, _ in samples]
    out = align(rows, samples, prompt_width=3, completion_width=4, moe_layers=[1, 3])
    assert no_route(out[:, :, list(dense)]).all()
    assert out[0, 0, 1, 0] == route_value(0, 1, 0)  # the zero rows did not leak as expert 0
    torch.testing.assert_close(out, reference(samples, 3, 4, dense=dense), rtol=0, atol=0)


def test_uint16_payloads_above_255_experts():
    num_experts = 300
    samples = [(4, 6, 0, True), (2, 3, 1, True)]
    payloads = [encode_routed_experts(engine_rows(p, c, s, num_experts=num_experts)) for p, c, s, _ in samples]
    decoded = [decode_routed_experts(x) for x in payloads]
    assert all(d.dtype == np.uint16 for d in decoded) and max(int(d.max()) for d in decoded) > 255
    expected = reference(samples, 4, 6, num_experts=num_experts)
    for rows in (decoded, payloads):  # arrays, or payload strings decoded inline
        out = align(rows, samples, prompt_width=4, completion_width=6, num_experts=num_experts)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_torch_rows_and_wide_dtypes():
    samples = [(3, 3, 0, True), (2, 4, 0, True)]
    rows = [
        torch.from_numpy(engine_rows(3, 3)),  # uint8 tensor
        torch.from_numpy(engine_rows(2, 4).astype(np.int64)),  # legacy int64
    ]
    out = align(rows, samples, prompt_width=3, completion_width=4)
    torch.testing.assert_close(out, reference(samples, 3, 4), rtol=0, atol=0)


def test_out_buffer_is_fully_overwritten():
    samples = [(3, 4, 1, True), (2, 2, 0, False), (1, 5, 0, True)]
    rows = [engine_rows(p, c, s, dense=(2,)) if has else None for p, c, s, has in samples]
    buffer = torch.full((3, 9, L, K), 77, dtype=torch.int16)  # stale contents from a previous batch
    out = align(rows, samples, prompt_width=4, completion_width=5, moe_layers=[0, 1, 3], out=buffer)
    assert out.data_ptr() == buffer.data_ptr()
    torch.testing.assert_close(out, reference(samples, 4, 5, dense=(2,)), rtol=0, atol=0)
    for bad in (
        torch.empty(3, 9, L, K + 1, dtype=torch.int16),
        torch.empty(3, 9, L, K, dtype=torch.int32),
        torch.empty(3, L, 9, K, dtype=torch.int16).transpose(1, 2),
    ):
        with pytest.raises(
            RouteAlignmentError, match=r"out must be a contiguous int16 CPU tensor of shape \(3, 9, 4, 2\)"
        ):
            align(rows, samples, prompt_width=4, completion_width=5, out=bad)


# ----------------------------------------------------------------------------- codec


@pytest.mark.parametrize("num_experts, dtype", [(64, np.uint8), (256, np.uint8), (257, np.uint16), (512, np.uint16)])
def test_engine_dtype_follows_vllm_capturer(num_experts, dtype):
    assert engine_dtype(num_experts) == dtype


@pytest.mark.parametrize("num_experts", [128, 300])
def test_encode_is_vllm_numpy2base64_and_decode_inverts_it(num_experts):
    array = engine_rows(6, 5, num_experts=num_experts)
    payload = encode_routed_experts(array)
    assert payload == vllm_numpy2base64(array)
    decoded = decode_routed_experts(payload)
    reference_load = np.load(io.BytesIO(base64.b64decode(payload)), allow_pickle=False)
    assert decoded.dtype == array.dtype == reference_load.dtype
    np.testing.assert_array_equal(decoded, array)
    np.testing.assert_array_equal(decoded, reference_load)


def test_encode_with_num_experts_casts_to_the_engine_dtype():
    ids = engine_rows(3, 3, num_experts=300, dtype=np.int64)
    assert decode_routed_experts(encode_routed_experts(ids, num_experts=300)).dtype == np.uint16
    small = engine_rows(3, 3, dtype=np.int64)
    decoded = decode_routed_experts(encode_routed_experts(torch.from_numpy(small), num_experts=E))
    assert decoded.dtype == np.uint8
    np.testing.assert_array_equal(decoded, small)
    with pytest.raises(RouteAlignmentError, match=r"\[0, 8\)"):
        encode_routed_experts(small, num_experts=8)


def test_decode_fortran_order_big_endian_and_empty():
    array = np.asfortranarray(engine_rows(3, 4, num_experts=300)).astype(">u2")
    decoded = decode_routed_experts(vllm_numpy2base64(array))
    np.testing.assert_array_equal(decoded, array)
    empty = np.zeros((0, L, K), np.uint8)
    assert decode_routed_experts(encode_routed_experts(empty)).shape == (0, L, K)


def _npy_b64(array, allow_pickle=False):
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=allow_pickle)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


@pytest.mark.parametrize(
    "payload, message",
    [
        (b"AAAA", "must be a base64 str"),
        (None, "must be a base64 str"),
        ("not base64 !!!", "not valid base64"),
        ("QUJ", "not valid base64"),  # missing padding
        ("QU=J", "not valid base64"),  # padding inside the data
        ("é" * 8, "not valid base64"),
        (base64.b64encode(b"hello world, not npy").decode(), "not a readable .npy"),
        (vllm_numpy2base64(engine_rows(3, 3))[:-40], "not a readable .npy"),  # truncated
        (_npy_b64(np.zeros((3, L, K), np.float32)), "integer expert ids, got dtype float32"),
        (_npy_b64(np.zeros((3, L, K), bool)), "integer expert ids, got dtype bool"),
        (_npy_b64(np.zeros((3, L), np.uint8)), r"3-D .* got shape \(3, 4\)"),
        (_npy_b64(np.array([[[1]]], dtype=object), allow_pickle=True), "dtype object"),
    ],
)
def test_decode_rejects(payload, message):
    with pytest.raises(RouteAlignmentError, match=message):
        decode_routed_experts(payload)


# ----------------------------------------------------------------------------- alignment errors

GOOD = (3, 4, 0)


def _batch_with_bad_sample(bad_rows, bad=(3, 4, 0), **kwargs):
    """Sample 0 is fine; sample 1 carries the problem, so the message must name sample 1."""
    samples = [(*GOOD, True), (*bad, True)]
    good_rows = engine_rows(*GOOD, num_experts=kwargs.get("num_experts", E))
    return align([good_rows, bad_rows], samples, **{"prompt_width": 4, "completion_width": 5, **kwargs})


@pytest.mark.parametrize(
    "bad_rows, bad, kwargs, message",
    [
        (
            engine_rows(3, 5),
            (3, 4, 0),
            {},
            r"expected prompt 3 \+ completion 4 - 1 - prompt_start 0 = 6 engine rows, got 7",
        ),
        (engine_rows(3, 3), (3, 4, 0), {}, "= 6 engine rows, got 5"),
        (engine_rows(3, 4, 0), (3, 4, 1), {}, "= 5 engine rows, got 6"),  # prompt_start not applied by server
        (engine_rows(3, 4, layers=L + 1), (3, 4, 0), {}, r"shape \[6, 4, 2\] .* got \(6, 5, 2\)"),
        (engine_rows(3, 4, top_k=K + 1), (3, 4, 0), {}, r"shape \[6, 4, 2\] .* got \(6, 4, 3\)"),
        (engine_rows(3, 4)[:, 0], (3, 4, 0), {}, r"got \(6, 2\)"),
        (engine_rows(5, 4), (5, 4, 0), {}, "prompt has 5 tokens but prompt_width is 4"),
        (engine_rows(3, 6), (3, 6, 0), {}, "completion has 6 tokens but completion_width is 5"),
        (engine_rows(3, 4), (3, 4, 4), {}, r"prompt_start=4 is outside \[0, prompt length 3\]"),
        (engine_rows(3, 1, 3), (3, 0, 3), {}, "= -1 engine rows, got 0"),  # nothing left to route
        (engine_rows(3, 4).astype(np.float32), (3, 4, 0), {}, "integer expert ids, got dtype float32"),
        (engine_rows(3, 4).tolist(), (3, 4, 0), {}, "got list"),
        ("%%%", (3, 4, 0), {}, "not valid base64"),
        (engine_rows(3, 4), (3, 4, 0), {"num_experts": 16}, "expected ids < 16"),
        (engine_rows(3, 4, num_experts=300) + 100, (3, 4, 0), {"num_experts": 256}, "id 2.. at .* expected ids < 256"),
        (engine_rows(3, 4, dense=(1,)), (3, 4, 0), {}, "layer 1 is in moe_layers but position 0 has an all-zero"),
        (engine_rows(3, 4), (3, 4, 0), {"moe_layers": [0, 1, 3]}, "layer 2 is not in moe_layers"),
    ],
)
def test_alignment_errors_name_the_sample(bad_rows, bad, kwargs, message):
    if "moe_layers" in kwargs:  # sample 0 must stay valid under the same moe_layers
        dense = [layer for layer in range(L) if layer not in kwargs["moe_layers"]]
        samples = [(*GOOD, True), (*bad, True)]
        rows = [engine_rows(*GOOD, dense=dense), bad_rows]
        with pytest.raises(RouteAlignmentError, match="sample 1: " + message):
            align(rows, samples, prompt_width=4, completion_width=5, **kwargs)
        return
    with pytest.raises(RouteAlignmentError, match="sample 1: .*" + message) as error:
        _batch_with_bad_sample(bad_rows, bad, **kwargs)
    assert error.value.sample == 1


def test_negative_ids_are_rejected():
    rows = engine_rows(3, 4, dtype=np.int32)
    rows[4, 2, 1] = -1
    with pytest.raises(RouteAlignmentError, match="sample 1: negative expert id -1 at position 4, layer 2"):
        _batch_with_bad_sample(rows)


def test_an_all_zero_last_row_in_a_moe_layer_falls_back_at_that_position_only():
    rows = engine_rows(3, 4)
    rows[-1, 2] = 0  # never written, at one MoE layer: the whole position (every layer) falls back
    reports = []
    out = _batch_with_bad_sample(rows, on_unwritten=reports.append)
    assert [(r.sample, r.count, r.first) for r in reports] == [(1, 1, 5)]
    expected = reference([(*GOOD, True), (3, 4, 0, True)], 4, 5)
    expected[1, 4 - 3 + 5] = -1  # column of position 5
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_uint16_ids_beyond_int16_are_rejected():
    rows = engine_rows(3, 4, num_experts=300)
    rows[2, 3, 0] = 40000
    with pytest.raises(RouteAlignmentError, match="sample 1: expert id 40000 at position 2, layer 3 .*< 32768"):
        _batch_with_bad_sample(rows)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"prompt_lengths": [3]}, "prompt_lengths has 1 entries but rows has 2"),
        ({"completion_lengths": [4, 4, 4]}, "completion_lengths has 3 entries but rows has 2"),
        ({"prompt_starts": [0]}, "prompt_starts has 1 entries"),
        ({"prompt_lengths": [3, -1]}, r"sample 1: prompt_lengths\[1\] must be an int >= 0"),
        ({"completion_lengths": [4, 2.0]}, r"sample 1: completion_lengths\[1\] must be an int"),
        ({"moe_layers": [0, 4]}, r"moe_layers must be distinct decoder-layer indices in \[0, 4\)"),
        ({"moe_layers": [1, 1, 2]}, "moe_layers must be distinct"),
        # a non-integral index is refused, never truncated to a neighbouring layer (1.7 -> 1)
        ({"moe_layers": [0, 1.7]}, r"\(ints\), got \[0, 1.7\]"),
        ({"moe_layers": [0, 1.0]}, r"\(ints\), got \[0, 1.0\]"),
        ({"moe_layers": [True, 2]}, r"\(ints\), got \[True, 2\]"),
        ({"moe_layers": np.array([0.0, 2.5])}, r"\(ints\), got \[0.0, 2.5\]"),
        ({"num_experts": 40000}, "does not fit int16"),
        ({"top_k": 0}, "top_k must be an int >= 1"),
        ({"prompt_width": -1}, "prompt_width must be an int >= 0"),
    ],
)
def test_batch_level_errors(kwargs, message):
    base = dict(
        prompt_lengths=[3, 3],
        completion_lengths=[4, 4],
        prompt_width=4,
        completion_width=5,
        num_layers=L,
        top_k=K,
    )
    with pytest.raises(RouteAlignmentError, match=message):
        routes_from_engine([engine_rows(3, 4), engine_rows(3, 4)], **{**base, **kwargs})


def test_errors_are_route_validation_and_value_errors():
    assert issubclass(RouteAlignmentError, RouteValidationError) and issubclass(RouteAlignmentError, ValueError)
    with pytest.raises(ValueError):
        routes_from_engine(
            "abc", prompt_lengths=[], completion_lengths=[], prompt_width=1, completion_width=1, num_layers=L, top_k=K
        )


# ----------------------------------------------------------------------------- fallback instead of raising


def test_on_error_falls_back_per_sample_and_reports_each_bad_one():
    samples = [(3, 4, 0, True), (3, 4, 0, True), (2, 3, 1, True), (3, 4, 0, True), (4, 5, 0, True), (3, 2, 0, True)]
    rows = [
        engine_rows(3, 4),
        engine_rows(3, 4)[:-1],  # trimmed one row too many (wrong length)
        engine_rows(2, 3, 1),
        "%%% not base64",
        engine_rows(4, 5, top_k=K + 1),  # wrong top-k
        engine_rows(3, 2).astype(np.float32),
    ]
    errors = []
    out = align(rows, samples, prompt_width=4, completion_width=5, on_error=errors.append)
    assert [e.sample for e in errors] == [1, 3, 4, 5]
    assert all(isinstance(e, RouteAlignmentError) and str(e).startswith(f"sample {e.sample}:") for e in errors)
    good = [i for i in range(6) if i not in (1, 3, 4, 5)]
    expected = reference([samples[i] for i in good], 4, 5)
    torch.testing.assert_close(out[good], expected, rtol=0, atol=0)
    assert no_route(out[[1, 3, 4, 5]]).all()  # the router's own choice


def test_on_error_does_not_hide_the_callers_own_mistakes():
    with pytest.raises(RouteAlignmentError, match="sample 0: prompt has 3 tokens but prompt_width is 2"):
        routes_from_engine(
            [engine_rows(3, 4)],
            prompt_lengths=[3],
            completion_lengths=[4],
            prompt_width=2,
            completion_width=5,
            num_layers=L,
            top_k=K,
            on_error=lambda error: None,
        )


def test_public_api_is_exported_from_the_routing_package():
    import trl_moe_replay.routing as routing

    assert routing.decode_routed_experts is decode_routed_experts and routing.routes_from_engine is routes_from_engine
    rows = engine_rows(3, 4, num_experts=300)
    out = routing.routes_from_engine(
        [vllm_numpy2base64(rows), None],
        prompt_lengths=[3, 2],
        completion_lengths=[4, 1],
        prompt_width=3,
        completion_width=4,
        num_layers=L,
        top_k=K,
    )
    torch.testing.assert_close(out, reference([(3, 4, 0, True), (2, 1, 0, False)], 3, 4, num_experts=300))


# ----------------------------------------------------------------------------- every row checked (issue 16)


def _long_rows(p=40, c=60, **kwargs):
    return engine_rows(p, c, **kwargs)


@pytest.mark.parametrize("position", [0, 1, 37, 62, 97])  # first row, chunk edges (chunk of 7 rows), middle, last
def test_a_repeated_id_in_any_row_is_rejected(monkeypatch, position):
    from trl_moe_replay.routing import codec

    monkeypatch.setattr(codec, "_CHECK_CHUNK_ROWS", 7, raising=False)  # many blocks: block edges are exercised
    rows = engine_rows(40, 60, top_k=4, num_experts=64)
    rows[position, 2, 3] = rows[position, 2, 1]
    samples = [(40, 60, 0, True)]
    with pytest.raises(
        RouteAlignmentError,
        match=rf"sample 0: position {position}, layer 2 names expert "
        rf"{rows[position, 2, 1]} twice",
    ) as error:
        align([rows], samples, prompt_width=40, completion_width=60, top_k=4)
    assert error.value.sample == 0


@pytest.mark.parametrize("chunk", [5, 1 << 16], ids=["many blocks", "one block"])
def test_never_written_rows_anywhere_fall_back_one_position_at_a_time(monkeypatch, chunk):
    """vLLM's all-zero rows, and rows of -1s, at MoE layers: exactly those positions lose their routes, at every
    layer; every other position of the sample keeps the engine's, and the sample is no error."""
    from trl_moe_replay.routing import codec

    monkeypatch.setattr(codec, "_CHECK_CHUNK_ROWS", chunk, raising=False)
    rows = engine_rows(40, 60, dense=(0,), dtype=np.int16)
    rows[50, 3] = 0  # vLLM's capture buffer is zeros where it never wrote
    rows[[7, 8, 98], 1] = 0  # the very last row too
    rows[60, 2] = -1  # a peer's "never written" mark (NeMo-RL's -1)
    rows[61, 1:] = -1  # every MoE layer of the position
    rows[61, 0] = -1  # and its dense layer: the position is the engine's "nothing here"
    rows[7, 2, 1] = rows[7, 2, 0]  # garbage at another layer of a never-written position is not judged
    reports, errors = [], []
    out = align(
        [engine_rows(40, 60, dense=(0,)), rows],
        [(40, 60, 0, True)] * 2,
        prompt_width=40,
        completion_width=60,
        moe_layers=[1, 2, 3],
        num_experts=E,
        on_error=errors.append,
        on_unwritten=reports.append,
    )
    assert errors == [] and [(r.sample, r.count, r.first) for r in reports] == [(1, 6, 7)]
    expected = reference([(40, 60, 0, True)] * 2, 40, 60, dense=(0,)).long()
    expected[1, [7, 8, 50, 60, 61, 98]] = -1
    assert torch.equal(out.long(), expected.where(expected >= 0, 255))  # uint8 routes: 255 = no route
    assert (~has_route(out[1, :99, 1:]).all(-1)).sum() == 6


@pytest.mark.parametrize("mark", [0, -1], ids=["zeros", "minus one"])
def test_a_sample_whose_every_row_is_never_written_falls_back_whole(mark):
    """Nothing left to replay: the sample is an error (and, with on_error, a whole-sample fallback), as before."""
    rows = engine_rows(3, 4, dtype=np.int16)
    rows[:, 1 + np.arange(6) % 3] = mark  # a different MoE layer at each position
    with pytest.raises(
        RouteAlignmentError,
        match="sample 1: layer 1 is in moe_layers but position 0 has .*and so has every other of its 6 positions",
    ):
        _batch_with_bad_sample(rows)
    errors, reports = [], []
    out = _batch_with_bad_sample(rows, on_error=errors.append, on_unwritten=reports.append)
    assert [e.sample for e in errors] == [1] and reports == [] and no_route(out[1]).all()


def test_a_partial_mark_is_malformed_and_top1_minus_one_is_a_mark():
    """A route mixing ids and -1 is no mark: the sample falls back whole. With top-1, zeros are expert 0 (real),
    while a -1 marks the position."""
    rows = engine_rows(3, 4, dtype=np.int16)
    rows[4, 2, 1] = -1
    with pytest.raises(RouteAlignmentError, match="sample 1: negative expert id -1 at position 4, layer 2"):
        _batch_with_bad_sample(rows)
    top1 = engine_rows(3, 4, top_k=1, dtype=np.int16)
    top1[2] = 0
    top1[3, 1] = -1
    reports = []
    out = align([top1], [(3, 4, 0, True)], prompt_width=3, completion_width=4, top_k=1, on_unwritten=reports.append)
    assert [(r.count, r.first) for r in reports] == [(1, 3)]
    assert out[0, 2].eq(0).all() and no_route(out[0, 3]).all() and has_route(out[0, [0, 1, 2, 4, 5]]).all()


def test_rows_are_checked_at_the_moe_layers_only_contiguous_or_not(monkeypatch):
    from trl_moe_replay.routing import codec

    monkeypatch.setattr(codec, "_CHECK_CHUNK_ROWS", 9, raising=False)
    for dense, moe in (((0,), [1, 2, 3]), ((1, 3), [0, 2])):
        rows = engine_rows(20, 30, dense=dense)  # dense layers all-zero: legitimate
        out = align([rows], [(20, 30, 0, True)], prompt_width=20, completion_width=30, moe_layers=moe)
        torch.testing.assert_close(out, reference([(20, 30, 0, True)], 20, 30, dense=dense), rtol=0, atol=0)
        bad = rows.copy()
        bad[33, moe[-1], 1] = bad[33, moe[-1], 0]
        with pytest.raises(RouteAlignmentError, match=f"position 33, layer {moe[-1]} names expert"):
            align([bad], [(20, 30, 0, True)], prompt_width=20, completion_width=30, moe_layers=moe)


def test_top1_rows_of_expert_zero_and_wide_dtypes_are_legitimate():
    rows = np.zeros((6, L, 1), np.uint8)  # top-1: a single expert 0 is a real route, not "never written"
    out = align([rows], [(3, 4, 0, True)], prompt_width=3, completion_width=4, top_k=1)
    assert out[0, :6].eq(0).all() and no_route(out[0, 6]).all()
    for dtype in (np.int64, np.uint16, np.int8, ">u2"):
        rows = engine_rows(3, 4).astype(dtype)
        bad = rows.copy()
        bad[2, 0, 1] = bad[2, 0, 0]
        align([rows], [(3, 4, 0, True)], prompt_width=3, completion_width=4)
        with pytest.raises(RouteAlignmentError, match="position 2, layer 0 names expert"):
            align([bad], [(3, 4, 0, True)], prompt_width=3, completion_width=4)


def test_on_error_falls_back_for_repeated_and_never_written_rows():
    samples = [(3, 4, 0, True)] * 4
    repeated, zero = engine_rows(3, 4), engine_rows(3, 4)
    repeated[3, 1, 0] = repeated[3, 1, 1]
    zero[2, 0] = 0
    errors = []
    out = align(
        [engine_rows(3, 4), repeated, zero, engine_rows(3, 4)],
        samples,
        prompt_width=3,
        completion_width=4,
        on_error=errors.append,
    )
    assert [e.sample for e in errors] == [1]  # a repeated id is malformed data: the whole sample falls back
    assert no_route(out[1]).all()
    expected = reference([samples[0]] * 3, 3, 4)
    expected[1, 2] = -1  # a never-written position: that one alone
    torch.testing.assert_close(out[[0, 2, 3]], expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", ["m8[s]", "M8[s]", "m8[ns]", bool])
def test_time_and_bool_dtypes_are_not_expert_ids(dtype):
    array = engine_rows(3, 4).astype(np.int64).astype(dtype)
    with pytest.raises(RouteAlignmentError, match=re.escape(f"integer expert ids, got dtype {np.dtype(dtype)}")):
        decode_routed_experts(_npy_b64(array))
    errors = []
    out = align(
        [engine_rows(3, 4), _npy_b64(array), array],
        [(3, 4, 0, True)] * 3,
        prompt_width=3,
        completion_width=4,
        on_error=errors.append,
    )
    assert [e.sample for e in errors] == [1, 2]
    assert all("integer expert ids" in str(e) for e in errors)
    assert no_route(out[1:]).all() and out[0, :6].ge(0).all()
    with pytest.raises(RouteAlignmentError, match="integer expert ids"):
        encode_routed_experts(array)


def test_a_header_whose_shape_overflows_int64_is_a_clean_error():
    header = {"descr": "|u1", "fortran_order": False, "shape": (2**32, 2**32, 2)}  # 2**65 elements
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, header)
    payload = base64.b64encode(buffer.getvalue() + b"\x00" * 16).decode()
    with pytest.raises(RouteAlignmentError, match="not a readable .npy"):
        decode_routed_experts(payload)


def test_repeated_route_search_matches_a_per_route_reference(monkeypatch):
    """The vectorised search (flat shifted comparisons, OR-reduced per block) against a plain loop over routes, for
    many top-k sizes, dtypes, layer subsets, block sizes and planted repeats, including the very last route."""
    from trl_moe_replay.routing import codec

    rng = np.random.default_rng(0)
    for trial in range(300):
        k = int(rng.integers(2, 10))
        tokens, layers = int(rng.integers(1, 30)), int(rng.integers(1, 5))
        dtype = rng.choice([np.uint8, np.uint16, np.int32, np.int64])
        experts = int(rng.integers(k, 40))
        rows = np.stack([rng.permutation(experts)[:k] for _ in range(tokens * layers)]).astype(dtype)
        rows = rows.reshape(tokens, layers, k)
        for _ in range(int(rng.integers(0, 3))):  # plant repeats (or zeros) at random routes
            t, layer, a, b = rng.integers(tokens), rng.integers(layers), *rng.choice(k, 2, replace=False)
            rows[t, layer, a] = rows[t, layer, b] if rng.random() < 0.8 else 0
            if rng.random() < 0.3:
                rows[t, layer] = 0
        if rng.random() < 0.3:
            rows = np.asfortranarray(rows)  # not C-contiguous: the block-copy path
        moe = sorted(rng.choice(layers, int(rng.integers(1, layers + 1)), replace=False).tolist())
        monkeypatch.setattr(codec, "_CHECK_CHUNK_ROWS", int(rng.integers(1, 40)))
        expected = next(
            ((t, layer) for t in range(tokens) for layer in moe if len(set(rows[t, layer].tolist())) < k), None
        )
        # private on purpose: the chunked search itself, against a plain loop (the public path only says "repeated")
        assert codec._first_repeated_row(rows, moe) == expected, (trial, k, rows.shape, moe)


# ----------------------------------------------------------------------------- one byte per entry
@pytest.mark.parametrize(
    ("num_experts", "top_k", "dtype"),
    [(8, 2, torch.uint8), (255, 1, torch.uint8), (256, 8, torch.uint8), (256, 1, torch.int16), (257, 8, torch.int16)],
)
def test_routes_stay_one_byte_per_entry_where_an_id_and_no_route_fit(num_experts, top_k, dtype):
    assert route_dtype(num_experts, top_k) == dtype
    rows = [(np.arange(3 * 2 * top_k).reshape(3, 2, top_k) % num_experts).astype(engine_dtype(num_experts)), None]
    out = routes_from_engine(
        rows,
        prompt_lengths=[2, 2],
        completion_lengths=[2, 2],
        prompt_width=2,
        completion_width=2,
        num_layers=2,
        top_k=top_k,
        num_experts=num_experts,
    )
    assert out.dtype == dtype and out.element_size() == (1 if dtype == torch.uint8 else 2)
    routed = has_route(out)  # [B, S, L]
    assert routed[0, :3].all() and not routed[0, 3].any() and not routed[1].any()  # final token, no-rows sample
    assert torch.equal(out[0, :3].long(), torch.from_numpy(rows[0].astype(np.int64)))
    validate_routes(out, num_layers=2, top_k=top_k, num_experts=num_experts)


# ----------------------------------------------------------------------------- threads (issue 24)
def test_threaded_alignment_equals_sequential_with_errors_in_sample_order(monkeypatch):
    """Large batches are placed by a thread pool: same tensor, same errors, reported in sample order, as one thread."""
    import threading

    from trl_moe_replay.routing import codec
    from trl_moe_replay.routing.codec import EngineTurn

    samples = [(12, 30, 0, True)] * 9
    rows = [engine_rows(12, 30) for _ in samples]
    rows[1][5, 2, 1] = rows[1][5, 2, 0]  # repeated id
    rows[4] = None  # no routes
    rows[5] = rows[5].astype(np.int16)
    rows[5][40, 0, 0] = 99  # out of range (E = 64)
    rows[6] = [EngineTurn(engine_rows(12, 30), 12, 30)]  # a multi-turn sample, placed by the calling thread
    rows[7][10, 3] = 0  # never written
    rows[8] = encode_routed_experts(rows[8])  # a payload decoded in the worker

    sample_rows = codec._sample_rows

    def run(threaded_bytes):
        monkeypatch.setattr(codec, "_THREADED_BYTES", threaded_bytes)
        monkeypatch.setattr(codec, "_CHECK_CHUNK_ROWS", 16)  # many blocks per sample
        errors, threads, reports = [], set(), []

        def recording(*args, **kwargs):
            threads.add(threading.current_thread().name)
            return sample_rows(*args, **kwargs)

        monkeypatch.setattr(codec, "_sample_rows", recording)
        out = align(
            rows,
            samples,
            prompt_width=12,
            completion_width=30,
            num_experts=E,
            on_error=errors.append,
            on_unwritten=reports.append,
        )
        with pytest.raises(RouteAlignmentError) as first:
            align(rows, samples, prompt_width=12, completion_width=30, num_experts=E)
        return out, [(e.sample, str(e)) for e in errors], str(first.value), threads, reports

    seq_out, seq_errors, seq_first, seq_threads, seq_reports = run(1 << 60)
    thr_out, thr_errors, thr_first, thr_threads, thr_reports = run(0)
    assert seq_threads == {threading.current_thread().name}
    assert any(name.startswith("trl_moe_replay-routes") for name in thr_threads)
    assert torch.equal(thr_out, seq_out)
    assert [sample for sample, _ in seq_errors] == [1, 5]
    assert thr_errors == seq_errors and thr_first == seq_first == seq_errors[0][1]
    assert thr_reports == seq_reports and [(r.sample, r.first) for r in seq_reports] == [(7, 10)]
    assert no_route(seq_out[[1, 4, 5]]).all()
    expected = reference([samples[0]], 12, 30)[0].long()  # int16, -1 = no route; uint8 out: 255
    for good in (0, 2, 3, 6, 7, 8):
        sample = expected.clone()
        if good == 7:  # its never-written position alone falls back
            sample[10] = -1
        assert torch.equal(seq_out[good].long(), sample.where(sample >= 0, 255))


def test_checked_engine_routes_hold_what_was_checked_for_their_layout():
    """checked_routes_from_engine checks every row once and keeps the result to itself (RouterReplay.replay then skips
    its host pass); what it was checked for is its layout. A reused ``out`` of routes_from_engine, rewritten through
    NumPy, is a plain tensor that replay() checks in full; the checked routes never share it."""
    from trl_moe_replay.routing import RouteLayout, checked_routes_from_engine

    layout = RouteLayout(num_layers=L, top_k=K, num_experts=E, moe_layers=(0, 1, 3))
    widths = dict(prompt_lengths=[3, 3], completion_lengths=[4, 4], prompt_width=4, completion_width=5)
    rows = [engine_rows(3, 4, dense=[2]), engine_rows(3, 4, dense=[2])]
    checked = checked_routes_from_engine(rows, layout, **widths)
    out = routes_from_engine(rows, num_layers=L, top_k=K, num_experts=E, moe_layers=[0, 1, 3], **widths)
    assert torch.equal(checked.tensor(), out) and checked.layout == layout
    assert layout.holds(RouteLayout(L, K, E, (1, 3))) and layout.holds(RouteLayout(L, K, E + 1, (0, 1, 3)))
    assert not layout.holds(RouteLayout(L, K, E - 1, (1, 3)))  # ids < E were checked, not < E - 1
    assert not layout.holds(RouteLayout(L, K, E, tuple(range(L))))  # layer 2 was not checked
    repeated = engine_rows(3, 4, dense=[2]).copy()
    repeated[2, 1] = repeated[2, 1, 0]
    with pytest.raises(RouteAlignmentError, match="twice"):
        routes_from_engine(
            [engine_rows(3, 4, dense=[2]), repeated],
            out=out,
            num_layers=L,
            top_k=K,
            num_experts=E,
            moe_layers=[0, 1, 3],
            **widths,
        )
    out.numpy()[1, 5, 1] = 0  # a write torch's version counter does not see: the buffer is a plain tensor ...
    with pytest.raises(RouteValidationError, match="names the same expert twice"):
        layout.validate(out)  # ... which replay() checks in full
    assert torch.equal(
        checked.tensor(),
        routes_from_engine(rows, num_layers=L, top_k=K, num_experts=E, moe_layers=[0, 1, 3], **widths),
    )  # unchanged by it

"""Pure parts of weight_sync: the flattened_bucket byte format, bucketing, protocol bodies and replies, the
receiver's session rules, the model loader and the checksum. No processes; the multi-process paths are in
test_weight_sync_group.py and test_weight_sync_e2e.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from weight_sync import protocol
from weight_sync.buckets import (
    BucketBuilder,
    TensorMeta,
    dtype_name,
    empty_flat,
    flatten_tensors,
    layout,
    make_buckets,
    metas_from_request,
    parse_dtype,
    unflatten,
)
from weight_sync.config import WeightSyncConfig
from weight_sync.protocol import Reply
from weight_sync.receiver import WeightReceiver, copy_into, weights_checksum
from weight_sync.sender import EngineSpec, hf_name, rank_layout

pytestmark = pytest.mark.timeout(60)


def _mixed() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(4, 4, generator=gen)),
        ("b.bias", torch.randn(4, generator=gen).to(torch.bfloat16)),  # 8 bytes: keeps 4-byte alignment
        ("c.steps", torch.tensor(7, dtype=torch.int64)),  # a scalar, shape []
        ("d.weight", torch.randn(2, 3, generator=gen).t()),  # not contiguous
    ]


def test_flattened_bucket_is_sglang_byte_layout() -> None:
    named = _mixed()
    flat = flatten_tensors([t for _, t in named])
    # SGLang's definition: each tensor flattened (C order) and viewed as bytes, concatenated without padding.
    expected = b"".join(
        t.contiguous().view(torch.uint8).numpy().tobytes()
        if t.dtype == torch.bfloat16
        else np.ascontiguousarray(t.numpy()).tobytes()
        for _, t in named
    )
    assert flat.dtype == torch.uint8 and flat.dim() == 1
    assert flat.numpy().tobytes() == expected
    metas = [TensorMeta.of(n, t) for n, t in named]
    assert sum(m.nbytes for m in metas) == flat.numel()
    back = unflatten(flat.clone(), metas)
    for (name, orig), (name2, got) in zip(named, back, strict=True):
        assert name == name2 and got.dtype == orig.dtype and got.shape == orig.shape
        assert torch.equal(got, orig)


def test_unaligned_tensor_is_refused_before_any_receive() -> None:
    metas = [TensorMeta("x", torch.bfloat16, (3,)), TensorMeta("y", torch.float32, (2,))]  # y at byte 6
    with pytest.raises(ValueError, match="Unaligned received tensor y: byte offset 6"):
        empty_flat(metas)
    with pytest.raises(ValueError, match="Negative dimension"):
        layout([TensorMeta("z", torch.float32, (-1, 2))])
    with pytest.raises(ValueError, match=r"expected uint8 \[8\]"):
        unflatten(torch.empty(9, dtype=torch.uint8), [TensorMeta("w", torch.float32, (2,))])


def test_builder_keeps_order_budget_and_alignment() -> None:
    named = [
        ("p0", torch.zeros(100)),  # 400 B
        ("p1", torch.zeros(100)),  # 400 B
        ("p2", torch.zeros(3, dtype=torch.bfloat16)),  # 6 B: the next fp32 would sit at a misaligned offset
        ("p3", torch.zeros(10)),  # 40 B
        ("big", torch.zeros(1000)),  # 4000 B > budget: travels alone
        ("p5", torch.zeros(1)),
    ]
    buckets = make_buckets(named, bucket_bytes=1000)
    assert [b.names for b in buckets] == [["p0", "p1", "p2"], ["p3"], ["big"], ["p5"]]
    for b in buckets:
        assert b.nbytes <= 1000 or len(b) == 1
        layout(b.metas)  # every bucket is receivable
    assert [n for b in buckets for n in b.names] == [n for n, _ in named]
    with pytest.raises(ValueError, match="bucket_bytes = 0"):
        BucketBuilder(0)


def test_dtype_names_have_no_torch_prefix() -> None:
    assert dtype_name(torch.bfloat16) == "bfloat16" and dtype_name(torch.float32) == "float32"
    assert parse_dtype("float8_e4m3fn") == torch.float8_e4m3fn
    for bad in ("torch.float32", "nope", "Tensor"):
        with pytest.raises(ValueError, match=f"dtypes: '{bad}' is not a torch dtype"):
            parse_dtype(bad)
    with pytest.raises(ValueError, match="equal lengths"):
        metas_from_request(["a"], ["float32", "float32"], [[1]])
    with pytest.raises(ValueError, match=r"shapes\[0\]"):
        metas_from_request(["a"], ["float32"], ["1x2"])


def test_update_body_round_trips_and_matches_sglang_fields() -> None:
    metas = [TensorMeta.of(n, t) for n, t in _mixed()]
    body = protocol.update_distributed_body(
        metas, group_name="g", flush_cache=False, weight_version="7", load_format="flattened_bucket"
    )
    assert set(body) == {
        "names",
        "dtypes",
        "shapes",
        "group_name",
        "flush_cache",
        "abort_all_requests",
        "weight_version",
        "load_format",
    }
    assert body["dtypes"] == ["float32", "bfloat16", "int64", "float32"]
    assert body["shapes"] == [[4, 4], [4], [], [3, 2]]
    parsed = protocol.parse_update_distributed(body)
    assert parsed.metas == metas and parsed.weight_version == "7" and parsed.flush_cache is False
    # SGLang defaults for the optional fields.
    minimal = protocol.parse_update_distributed({"names": ["a"], "dtypes": ["float32"], "shapes": [[2]]})
    assert (minimal.group_name, minimal.flush_cache, minimal.load_format) == (
        "weight_update_group",
        True,
        None,
    )
    with pytest.raises(ValueError, match="field 'names' is required"):
        protocol.parse_update_distributed({"dtypes": [], "shapes": []})
    with pytest.raises(ValueError, match="load_format = 'direct'"):
        protocol.update_distributed_body(metas, load_format="direct")


def test_init_group_body_and_lax_int_parsing() -> None:
    body = protocol.init_group_body(
        "10.0.0.1", 29500, rank_offset=3, world_size=5, group_name="g", backend="gloo"
    )
    assert protocol.parse_init_group(body) == protocol.InitGroupRequest("10.0.0.1", 29500, 3, 5, "g", "gloo")
    lax = protocol.parse_init_group({**body, "master_port": "29500"})  # AReaL sends the port as a string
    assert lax.master_port == 29500
    with pytest.raises(ValueError, match="field 'world_size' is required"):
        protocol.parse_init_group({"master_address": "a", "master_port": 1, "rank_offset": 1})
    with pytest.raises(ValueError, match="rank_offset = 0"):
        protocol.init_group_body("a", 1, rank_offset=0, world_size=2)
    with pytest.raises(ValueError, match="pause mode = 'stop'"):
        protocol.pause_body("stop")
    assert protocol.parse_pause_mode({}) == "abort"


def test_reply_semantics() -> None:
    assert Reply(200, {"success": True, "message": "x"}).ok
    assert not Reply(200, {"success": False, "message": "no"}).ok
    assert Reply(200, {"message": protocol.MSG_PAUSED, "status": "ok"}).ok
    bad = Reply(400, {"success": False, "message": protocol.MSG_SESSION_REQUIRED})
    assert (
        not bad.ok and bad.message == protocol.MSG_SESSION_REQUIRED and bad.describe().startswith("HTTP 400")
    )
    assert Reply(404, {"detail": "Not Found"}).not_found
    assert (
        Reply(400, {"error": {"message": "Get parameter by name failed"}}).message
        == "Get parameter by name failed"
    )
    dead = Reply(0, None, "ServerDisconnectedError")
    assert dead.transport_failed and not dead.ok and dead.describe() == "transport: ServerDisconnectedError"


def test_rank_layout_follows_sglang() -> None:
    engines = [EngineSpec("http://a", 2), EngineSpec("http://b", 1), EngineSpec("http://c", 4)]
    offsets, world = rank_layout(engines)
    assert offsets == {"http://a": 1, "http://b": 3, "http://c": 4} and world == 8
    with pytest.raises(ValueError, match="must start with http"):
        EngineSpec("localhost:30000")
    assert hf_name("_orig_mod.model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight") == (
        "model.layers.0.mlp.up_proj.weight"
    )


def test_receiver_session_rules_match_sglang_0_5_23() -> None:
    loaded: list = []
    receiver = WeightReceiver(loaded.extend, timeout_s=1)
    update = protocol.parse_update_distributed({"names": ["w"], "dtypes": ["float32"], "shapes": [[2]]})
    # Outside a session: refused before any receive is posted, nothing loaded.
    assert receiver.update(update) == (False, protocol.MSG_SESSION_REQUIRED)
    assert receiver.end() == (False, protocol.MSG_END_WITHOUT_BEGIN)
    assert receiver.begin() == (True, "Success")
    assert receiver.begin() == (False, protocol.MSG_BEGIN_TWICE)
    ok, message = receiver.update(update)  # in a session, but no group: SGLang's assertion text
    assert not ok and "Group weight_update_group not in []" in message
    assert receiver.end() == (True, "Success")
    assert receiver.destroy_group("weight_update_group") == (False, protocol.MSG_DESTROY_MISSING)
    assert loaded == [] and receiver.stats.begins == 1 and receiver.stats.ends == 1
    # SGLang 0.5.10 behaviour: no session needed, the missing group is what fails.
    old = WeightReceiver(loaded.extend, timeout_s=1, require_session=False)
    ok, message = old.update(update)
    assert not ok and message.startswith("Failed to receive weights: Group")


def test_copy_into_checks_names_and_shapes_before_copying() -> None:
    model = nn.Sequential(nn.Linear(3, 2))
    load = copy_into(model)
    before = model[0].weight.detach().clone()
    with pytest.raises(KeyError, match="'0.nope'"):
        load([("0.weight", torch.ones(2, 3)), ("0.nope", torch.ones(1))])
    assert torch.equal(model[0].weight, before)  # nothing copied from a bad bucket
    with pytest.raises(ValueError, match=r"0.bias: shape \[3\]"):
        load([("0.bias", torch.ones(3))])
    load([("0.weight", torch.full((2, 3), 2.0))])
    assert torch.equal(model[0].weight, torch.full((2, 3), 2.0))


def test_checksum_is_order_free_and_bit_sensitive() -> None:
    named = _mixed()
    digest = weights_checksum(named)
    assert weights_checksum(list(reversed(named))) == digest
    flipped = [(n, t.clone()) for n, t in named]
    flipped[0][1].view(torch.int32)[0, 0] ^= 1  # one bit of one float
    assert weights_checksum(flipped) != digest


def test_config_flush_follows_pause_mode() -> None:
    assert WeightSyncConfig().pause_mode == "in_place"
    assert WeightSyncConfig().flush() is False  # the KV cache of paused requests stays
    assert WeightSyncConfig(pause_mode="abort").flush() is True
    assert WeightSyncConfig(pause_mode="retract").flush() is True
    assert WeightSyncConfig(pause_mode="in_place", flush_cache=True).flush() is True
    assert WeightSyncConfig().resolved_load_format("nccl") == "flattened_bucket"
    assert WeightSyncConfig().resolved_load_format("gloo") == "per_tensor"
    assert WeightSyncConfig(load_format="flattened_bucket").resolved_load_format("gloo") == "flattened_bucket"
    with pytest.raises(ValueError, match="bucket_mb"):
        WeightSyncConfig(bucket_mb=0)

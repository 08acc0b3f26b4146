"""The real-model report (``python -m fusedkit bench --models``) at tiny sizes: fusedkit goes
where it should in each model, the fused model computes what the stock one does, forward
and backward, and the report's harness runs end to end."""

from __future__ import annotations

import copy
import dataclasses
import inspect

import pytest
import torch
from conftest import DEVICE, ON_GPU

from fusedkit.bench import models

CASES = list(models.MODELS)


def _case(name):
    case = models.MODELS[name]
    reason = models.unavailable(case)
    if reason is not None:
        pytest.skip(reason)
    return case


@pytest.mark.parametrize("name", CASES)
def test_fused_model_matches_stock(name):
    """Same weights, same batch: outputs and every parameter's gradient as the stock model's."""
    case = _case(name)
    torch.manual_seed(0)
    stock = case.build(True).to(DEVICE)
    fused = models.fuse(case, stock)
    calls = []
    import fusedkit

    originals = {n: getattr(fusedkit, n) for n in ("add_relu", "matmul", "silu_mul")}

    def spy(n):
        def call(*args, **kwargs):
            calls.append(n)
            return originals[n](*args, **kwargs)

        return call

    x, t = case.batch(case.small_sizes.train, torch.Generator().manual_seed(0), True)
    x, t = x.to(DEVICE), t.to(DEVICE)
    if case.whole or case.traced:  # fuse found the sites: the fused model calls fusedkit through its fx code
        assert fused.fusion_sites and type(fused) is type(stock)
        calls.append("fuse")
    for n in originals:
        setattr(fusedkit, n, spy(n))
    try:
        got = fused(x)
    finally:
        for n, f in originals.items():
            setattr(fusedkit, n, f)
    want = stock(x)
    assert calls, "the fused model never called fusedkit"
    if case.whole and not isinstance(want, torch.Tensor):
        got, want = got.logits, want.logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    if case.whole and case.loss is models._lm_loss:
        got, want = fused(x), stock(x)
    case.loss(got, t).backward()
    case.loss(want, t).backward()
    for (pname, p), q in zip(fused.named_parameters(), stock.parameters()):
        assert p.grad is not None, pname
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-4, msg=lambda m: f"{pname}: {m}")


@pytest.mark.parametrize("name", CASES)
def test_fuse_keeps_the_stock_model_and_its_state_dict(name):
    case = _case(name)
    stock = case.build(True)
    before = copy.deepcopy(stock.state_dict())
    fused = models.fuse(case, stock)
    assert fused.state_dict().keys() == stock.state_dict().keys()
    for k, v in stock.state_dict().items():
        assert torch.equal(v, before[k])
    assert "forward" not in vars(stock)


@pytest.mark.slow
def test_report_runs_end_to_end():
    """The report at tiny sizes: every variant measured, losses finite, the fused run's
    losses within float32 noise of stock's (no autocast on the CPU)."""
    # (a block: a whole model's 20 training steps take most of a minute in the interpreter;
    # its fusion and decode step are tested below)
    blocks = [n for n in CASES if not models.MODELS[n].whole]
    name = next((n for n in blocks if models.unavailable(models.MODELS[n]) is None), None)
    if name is None:
        pytest.skip("neither torchvision nor transformers imports here")
    # Two rounds: the second times training after the first round's inference (eval mode
    # and back).
    results, skipped = models.run_models([name], DEVICE, use_compile=False, small=True, progress=False, rounds=2)
    assert not skipped
    by_variant = {r.variant: r for r in results}
    peers = {p for p, *_ in models.MODELS[name].peers}
    assert set(by_variant) == {"eager", "eager2", "fusedkit"} | peers
    for r in results:
        assert len(r.losses) == models.LOSS_STEPS and all(torch.isfinite(torch.tensor(r.losses)))
    assert by_variant["eager2"].max_loss_rel_diff == 0.0 or ON_GPU
    for fused in {"fusedkit"} | peers & {"fusedkit_mlp"}:  # (Liger's are not ours to bound)
        assert by_variant[fused].max_loss_rel_diff < (1e-2 if ON_GPU else 1e-4), fused
    f = by_variant["fusedkit"]
    assert f.train_ms > 0 and f.bs1_ms > 0 and f.serve_ms > 0 and (f.gpu_ms is None or f.gpu_ms > 0)
    assert (f.peak_mb is not None) == ON_GPU and (f.gpu_ms is not None) == ON_GPU
    # (host_ms in ms, for a tiny block's step: a unit slip, s or us, falls outside. Not bounded by
    # train_ms: do_bench's step time overlaps a host-bound step's issue with its cache flush, and
    # for gpt2_mlp on an H100 under 14 test workers it came to a fifteenth of the host time)
    assert (f.host_ms is not None) == ON_GPU and (f.host_ms is None or 0.01 < f.host_ms < 100)
    table = models.format_models_table(results, {"other": "why"})
    assert name in table and "other" in table and "why" in table


@pytest.mark.slow  # generate in the interpreter (6 s on 2 cores)
def test_the_decode_step_of_a_fused_lm_gives_stocks_tokens():
    case = _case("gpt2")
    stock, train, _ = models.prepared(case, True, DEVICE)
    fused, _ = models.variant_model(case, "fusedkit", stock, DEVICE, train[0])
    reference = copy.deepcopy(stock).to(DEVICE)
    prompt = train[0][:1, :4]
    for batch in models.DECODE_BATCHES:
        ids = prompt.expand(batch, -1).contiguous()
        ms, out = models.decode(fused, ids, DEVICE, tokens=2, calls=1)
        _, want = models.decode(reference, ids, DEVICE, tokens=2, calls=1)
        assert ms > 0 and torch.equal(out, want) and out.shape == (batch, 6)


def test_decode_rows_take_turns_and_count_the_tokens_that_agree():
    # Each variant's timed calls alternate with the others' (a drifting host moves all alike);
    # a row counts its new tokens equal to stock eager's before the first that differs.
    calls = []

    class Canned(torch.nn.Module):  # a causal LM whose generate returns its canned tokens
        def __init__(self, name, new):
            super().__init__()
            self.name, self.new = name, torch.tensor(new)

        def generate(self, ids, **_):
            calls.append(self.name)
            return torch.cat([ids, self.new.expand(ids.shape[0], -1)], 1)

    lms = Canned("s", [5, 6, 7, 8]), Canned("f", [5, 6, 9, 8]), Canned("e", [5, 6, 7, 8])
    rows = [models.Result("m", v) for v in ("eager", "fusedkit", "eager2")]
    live = [(r, m, m, None) for r, m in zip(rows, lms)]
    models._decode_rows(live, {}, torch.zeros(1, 3, dtype=torch.long), torch.device("cpu"), small=True)
    assert [(r.decode_agree, r.decode_equal) for r in rows] == [(4, True), (2, False), (4, True)]
    assert calls == list("sfesfe") * len(models.DECODE_BATCHES)  # (warm-ups, then a round of timed calls)
    calls.clear()
    models.decode_side_by_side(lms[:2], torch.zeros(2, 3, dtype=torch.long), torch.device("cpu"), 4, calls=3)
    assert calls == list("sf" * 4)


def test_unavailable_names_the_package():
    case = dataclasses.replace(models.MODELS["resnet50"], package="no_such_package_fusedkit")
    assert "no_such_package_fusedkit" in models.unavailable(case)


@pytest.mark.slow  # runs a model through the report (10 s on 2 cores)
def test_peer_variants_run_where_they_import_and_work(monkeypatch):
    """A peer library's fusion is one more variant where its package imports and its fusion
    runs here; otherwise the report names why it is left out."""
    blocks = [n for n in CASES if not models.MODELS[n].whole]  # (a block's fusion takes the model alone)
    name = next((n for n in blocks if models.unavailable(models.MODELS[n]) is None), None)
    if name is None:
        pytest.skip("neither torchvision nor transformers imports here")
    case = models.MODELS[name]

    def broken(model, example=None):
        raise RuntimeError("no kernels for this device")

    case = dataclasses.replace(
        case,
        peers=(
            ("same", "torch", case.fuse),
            ("broken", "torch", broken),
            ("absent", "no_such_package_fusedkit", case.fuse),
        ),
    )
    monkeypatch.setitem(models.MODELS, name, case)
    results, skipped = models.run_models([name], DEVICE, use_compile=False, small=True, progress=False, rounds=1)
    assert {r.variant for r in results} == {"eager", "eager2", "fusedkit", "same"}
    assert "no_such_package_fusedkit" in skipped[f"{name} absent"]
    assert "no kernels for this device" in skipped[f"{name} broken"]


def test_gpu_busy_time_leaves_annotated_ranges_out():
    """An annotated range (``record_function``, a custom op's name, ``Optimizer.step``) spans
    kernels already counted: a kernel under one counts once."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    if "is_user_annotation" not in inspect.signature(FunctionEvent).parameters:
        pytest.skip("this torch's profiler events do not mark annotations")

    def event(name, start, end, device_type=DeviceType.CUDA, annotation=False):
        return FunctionEvent(0, name, 0, start, end, device_type=device_type, is_user_annotation=annotation)

    events = [
        event("Optimizer.step#SGD.step", 0, 100, annotation=True),
        event("sgd_kernel", 10, 60),
        event("copy", 70, 90),
        event("Optimizer.step#SGD.step", 0, 120, DeviceType.CPU),
    ]
    assert models.kernel_time_us(events) == 70


def test_processes_merge_to_medians_with_each_rows_own_count():
    """A row's numbers are medians over the processes that gave it; a case that failed in one
    process counts the others only; the range is stock eager / the variant's step per process."""

    def row(model, variant, train, agree=None):
        equal = None if agree is None else agree == 32
        return {"model": model, "variant": variant, "train_ms": train, "decode_equal": equal, "decode_agree": agree}

    runs = [
        [row("a", "eager", 10.0), row("a", "fusedkit", 5.0, 32), row("b", "eager", 4.0)],
        [row("a", "eager", 12.0), row("a", "fusedkit", 8.0, 17)],
        [row("a", "eager", 9.0), row("a", "fusedkit", 9.0, 32)],
    ]
    merged = {(m["model"], m["variant"]): m for m in models.merge_processes(runs)}
    fused = merged[("a", "fusedkit")]
    assert (fused["train_ms"], fused["processes"], fused["decode_equal"], fused["decode_agree"]) == (8.0, 3, False, 17)
    assert fused["train_x_range"] == [1.0, 2.0]
    assert (merged[("b", "eager")]["processes"], merged[("b", "eager")]["train_ms"]) == (1, 4.0)


def test_added_processes_keep_each_models_newest_three(tmp_path):
    """``--add`` gathers the record over several leases: each model keeps the rows of its newest
    three processes, whatever else those processes ran; a case that now runs drops its old
    'did not run'; every commit kept is named; a report of another GPU is refused."""
    import json

    def run(model, train, skipped=None):
        return {
            "models": [],
            "skipped": skipped or {},
            "processes": [[{"model": model, "variant": "eager", "train_ms": train}]],
        }

    path = tmp_path / "whole.json"
    env = {"gpu": "H200", "commit": "c1"}
    payload = models.add_processes(str(path), dict(env), run("a", 1.0, {"b": "no timm"}))
    for i, (model, commit) in enumerate([("a", "c2"), ("b", "c2"), ("a", "c3"), ("a", "c3")]):
        path.write_text(json.dumps({"environment": {**env, "commit": commit}, **payload}))
        new_env = {**env, "commit": commit}
        payload = models.add_processes(str(path), new_env, run(model, 2.0 + i))
    merged = {m["model"]: m for m in payload["models"]}
    assert merged["a"]["processes"] == 3 and merged["a"]["train_ms"] == 4.0  # 2, 4, 5: the 1.0 dropped
    assert merged["b"]["processes"] == 1 and "b" not in payload["skipped"]
    assert new_env["commits"] == ["c2", "c3"]
    with pytest.raises(SystemExit, match="H100"):
        models.add_processes(str(path), {"gpu": "H100"}, run("a", 1.0))

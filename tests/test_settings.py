"""Settings are an API: defaults from the environment, read once at import; changes through
``fusedkit.settings`` (checked when made, process-wide, put back by ``override``); fusedkit
never writes ``os.environ``."""

from __future__ import annotations

import dataclasses
import os
import pickle
import re
import subprocess
import sys

import pytest
import torch
from conftest import DEVICE

import fusedkit
from fusedkit.errors import ArgumentError
from fusedkit.settings import ENVIRONMENT, Settings, from_environment


def test_defaults_come_from_the_environment_read_once():
    plain = from_environment({})
    assert (plain.fp32_precision, plain.autotune, plain.matmul_kernel, plain.fast_launch, plain.native_launch) == (
        "tf32x3",
        True,
        "auto",
        True,
        True,
    )
    env = {
        "FUSEDKIT_FP32_MATMUL": "ieee",
        "FUSEDKIT_AUTOTUNE": "0",
        "FUSEDKIT_MATMUL_KERNEL": "tma",
        "FUSEDKIT_FAST_LAUNCH": "0",
        "FUSEDKIT_NATIVE_LAUNCH": "0",
        "FUSEDKIT_COMPILED_ELEMENTWISE": "kernel",
    }
    set_ = from_environment(env)
    assert plain.compiled_elementwise == "inductor" and set_.compiled_elementwise == "kernel"
    assert (set_.fp32_precision, set_.autotune, set_.matmul_kernel, set_.fast_launch, set_.native_launch) == (
        "ieee",
        False,
        "tma",
        False,
        False,
    )
    assert set(ENVIRONMENT.values()) == set(env)
    code = "import fusedkit; s = fusedkit.settings.current(); print(s.autotune, s.matmul_kernel)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env=dict(os.environ, FUSEDKIT_AUTOTUNE="0", FUSEDKIT_MATMUL_KERNEL="pointer"),
    )
    assert out.stdout.split() == ["False", "pointer"]


def test_norm_grad_recipes_are_on_unless_the_environment_turns_them_off():
    # (an escape hatch beside the settings: the norms' C++ autograd node, which compiled
    # autograd cannot trace yet, docs/design.md)
    code = "from fusedkit.runtime import norm; print(norm.GRAD_RECIPES_ON)"
    got = []
    for value in (None, "0"):
        env = {k: v for k, v in os.environ.items() if k != "FUSEDKIT_NORM_GRAD_RECIPES"}
        if value is not None:
            env["FUSEDKIT_NORM_GRAD_RECIPES"] = value
        got.append(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env))
    assert [g.stdout.strip() for g in got] == ["True", "False"]


@pytest.mark.parametrize(
    "variable,value",
    [
        ("FUSEDKIT_FP32_MATMUL", "fast"),
        ("FUSEDKIT_MATMUL_KERNEL", "cublas"),
        ("FUSEDKIT_AUTOTUNE", "yes"),
        ("FUSEDKIT_NATIVE_LAUNCH", ""),
    ],
)
def test_a_bad_environment_value_names_its_variable(variable, value):
    with pytest.raises(ArgumentError, match=variable):
        from_environment({variable: value})


def test_set_checks_values_and_returns_what_it_replaced(fk_settings):
    before = fusedkit.settings.current()
    previous = fusedkit.settings.set(autotune=not before.autotune)
    assert previous is before and fusedkit.settings.current().autotune is not before.autotune
    for bad in (
        dict(fp32_precision="tf32"),
        dict(matmul_kernel="fast"),
        dict(autotune=1),
        dict(native_launch="1"),
        dict(precision="ieee"),
    ):
        with pytest.raises(ValueError):
            fusedkit.settings.set(**bad)
    with pytest.raises(ValueError):
        fusedkit.settings.restore("tf32x3")
    fusedkit.settings.restore(before)
    assert fusedkit.settings.current() is before


def test_override_puts_the_settings_back_even_after_an_error():
    before = fusedkit.settings.current()
    with pytest.raises(RuntimeError):
        with fusedkit.settings.override(fp32_precision="ieee", autotune=False) as inside:
            assert inside is fusedkit.settings.current()
            assert fusedkit.get_fp32_precision() == "ieee" and not inside.autotune
            raise RuntimeError
    assert fusedkit.settings.current() is before


def test_fusedkit_never_writes_the_environment(fk_settings):
    environ = dict(os.environ)
    fusedkit.set_fp32_precision("ieee")
    with fusedkit.settings.override(matmul_kernel="pointer", autotune=False, fast_launch=False):
        fusedkit.matmul(torch.randn(4, 8, device=DEVICE), torch.randn(8, 4, device=DEVICE))
    assert dict(os.environ) == environ


def test_settings_are_one_object_per_set_of_values(fk_settings):
    """Kept matmul plans are keyed on the settings object: the same values give the same
    object (a block re-entered each step reuses its plans), other values another."""
    first = fusedkit.settings.current()
    fusedkit.settings.set(fp32_precision=first.fp32_precision)
    assert fusedkit.settings.current() is first
    with fusedkit.settings.override(autotune=not first.autotune) as a:
        pass
    with fusedkit.settings.override(autotune=not first.autotune) as b:
        assert b is a and b is not first and b != first
    assert isinstance(first, Settings) and from_environment({}) is from_environment({})


def test_fp32_precision_changes_what_a_float32_matmul_runs(fk_settings):
    if fusedkit.runtime.matmul.tf32_enabled():
        pytest.skip("PyTorch allows TF32 here: TF32 takes precedence")
    a, b = torch.randn(16, 32, device=DEVICE), torch.randn(32, 16, device=DEVICE)
    fusedkit.clear_caches()
    for precision in ("ieee", "tf32x3"):
        fusedkit.set_fp32_precision(precision)
        fusedkit.matmul(a, b)
        assert fusedkit.runtime.matmul.fp32_precision() == precision
    kept = {k.plan.meta["INPUT_PRECISION"] for k in fusedkit.runtime.matmul.KEPT.values()}
    assert kept == {"ieee", "tf32x3"} or fusedkit.backend_for(DEVICE) == "torch"


@pytest.mark.parametrize(
    "bad,words",
    [
        (dict(fp32_precision="bogus"), "fp32_precision='bogus'; choose from tf32x3, ieee"),
        (dict(matmul_kernel=None), "matmul_kernel=None; choose from auto, pointer, tma"),
        (dict(autotune=1), "autotune must be True or False, got 1"),
        (dict(native_launch="0"), "native_launch must be True or False, got '0'"),
    ],
)
def test_a_settings_object_is_checked_when_made(fk_settings, bad, words):
    """Every Settings is valid, however made: ``restore`` of a bad one was taken, and the
    interpreter's matmul failed later on it while the PyTorch path ignored it."""
    before = fusedkit.settings.current()
    with pytest.raises(ArgumentError, match=re.escape(words)):
        fusedkit.settings.restore(Settings(**bad))
    with pytest.raises(ArgumentError, match=re.escape(words)):
        dataclasses.replace(before, **bad)
    assert fusedkit.settings.current() is before


def test_settings_compare_and_hash_by_value(fk_settings):
    """Equal values are equal settings, however made; ``restore`` puts back the interned one,
    so a kept plan's key meets the same object as before."""
    assert Settings() == Settings() and hash(Settings()) == hash(Settings())
    assert Settings(autotune=False) != Settings() and Settings() != "tf32x3"
    assert len({Settings(), Settings(), Settings(autotune=False)}) == 2
    before = fusedkit.settings.current()
    fusedkit.settings.restore(dataclasses.replace(before, autotune=not before.autotune))
    fusedkit.settings.restore(Settings(**{f.name: getattr(before, f.name) for f in dataclasses.fields(before)}))
    assert fusedkit.settings.current() is before
    # Pickled as its values, made again where it is loaded: a str's hash differs from one
    # process to another, so a kept hash must not travel.
    assert b"_hash" not in pickle.dumps(before)
    copy = pickle.loads(pickle.dumps(before))
    assert copy == before and hash(copy) == hash(before)

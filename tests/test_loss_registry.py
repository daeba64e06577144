"""The loss registry is the one list of losses: the CLI choices, the config checks, the default optimizer,
``qie plan`` and the validation sampler all follow a loss's :class:`LossSpec`.

Contract tests (every registered loss is wired everywhere), and a throwaway loss registered here that
becomes a choice of ``qie train`` and ``qie plan`` and passes the checks with no other file touched.
"""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from diffsynth_qie.models.presets import get_preset
from diffsynth_qie.training.config import OPTIMIZER_DEFAULTS, LossConfig, RunConfig, TimestepConfig, TrainConfig
from diffsynth_qie.training.losses import registry
from diffsynth_qie.training.losses.registry import LOSSES, loss_names, loss_spec
from diffsynth_qie.training.losses.spec import LossSpec


def _choices(argv_command: str, dest: str = "loss") -> list[str]:
    from diffsynth_qie.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[argv_command]
    return list(next(a for a in sub._actions if a.dest == dest).choices)



def _teacher_file() -> str:
    """An empty LoRA file of the tiny preset: what --loss dmd's check reads before anything loads."""
    import tempfile

    from safetensors.torch import save_file

    path = tempfile.mkdtemp(prefix="qie-test-teacher-") + "/teacher.safetensors"
    save_file({}, path, metadata={"preset": "tiny"})
    return path


# what a loss's own check requires to be given (its flags without a usable default)
REQUIRED = {"nft": {"reward": "preserve"}, "dmd": {"teacher_lora": _teacher_file()}}


def _config(loss: str, **timesteps) -> RunConfig:
    cfg = RunConfig(train=TrainConfig(cache_dir="c", output_dir="o", model="tiny"), loss=LossConfig(loss=loss),
                    timesteps=TimestepConfig(**timesteps))
    if loss in REQUIRED:
        cfg = dataclasses.replace(cfg, **{loss: dataclasses.replace(getattr(cfg, loss), **REQUIRED[loss])})
    return cfg


# --- contracts: every registered loss is wired everywhere --------------------------------
def test_cli_choices_are_the_registry():
    assert _choices("train") == loss_names() == list(LOSSES)
    assert _choices("plan") == loss_names()


def test_every_loss_declares_a_valid_config_and_capabilities():
    from diffsynth_qie.commands.train import groups

    run_fields = {f.name: f for f in dataclasses.fields(RunConfig)}
    flag_groups = {attr: cls for cls, attr, _ in groups()}
    for name, spec in LOSSES.items():
        assert spec.name == name and spec.summary and callable(spec.fn)
        assert spec.default_optimizer in OPTIMIZER_DEFAULTS, name
        assert not (spec.bridge and spec.stratified_sigma), f"{name}: a bridge draws its own σ's"
        if spec.config is not None:  # its own config: a RunConfig field of its name, and a flag group if it has knobs
            assert name in run_fields and run_fields[name].default_factory is spec.config, name
            assert isinstance(spec.config_of(RunConfig()), spec.config)
            assert (flag_groups.get(name) is spec.config) == spec.has_flags, name
        if spec.check is not None and name in REQUIRED:  # its check refuses the config without what it needs
            bare = RunConfig(train=TrainConfig(cache_dir="c", output_dir="o", model="tiny"), loss=LossConfig(loss=name))
            with pytest.raises(ValueError, match=f"--loss {name} needs"):
                bare.resolved(get_preset("tiny"))
        resolved = _config(name).resolved(get_preset("tiny"))
        assert resolved.optim.optimizer == spec.default_optimizer
        # a config read back from a checkpoint's JSON gives the loss its config again
        back = json.loads(json.dumps(resolved.to_json()))
        assert spec.config_of(type("Saved", (), back)()) == spec.config_of(resolved)


# the steps every loss repeats, each defined once in training/losses/common.py (what its helper calls)
SHARED_STEPS = {"draw_timesteps(": "draw_flow_points", "add_noise(": "draw_flow_points",
                "flow_target(": "draw_flow_points", "join_prompt(": "joined_prompts", "mask_weights(": "pixel_weights"}


def test_every_loss_takes_the_repeated_steps_from_common():
    """A loss draws its σ and noise, builds the flow target, joins the prompt and weighs the mask through
    ``losses/common.py``, so a loss added later cannot grow its own copy (and the order of the draws is kept)."""
    import inspect

    for name, spec in LOSSES.items():
        source = inspect.getsource(inspect.getmodule(spec.fn))
        for call, helper in SHARED_STEPS.items():
            assert call not in source, f"--loss {name} calls {call.rstrip('(')} itself; use common.{helper}"


def test_registry_imports_no_torch():
    code = ("import sys; import diffsynth_qie.training.losses.registry as r; "
            "assert r.LOSSES and 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:3]")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_an_unknown_loss_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="--loss 'nope'.*" + ", ".join(loss_names())):
        _config("nope").resolved()
    with pytest.raises(ValueError, match="already registered"):
        registry.register(LossSpec(name=loss_names()[0], summary="x", fn=lambda *a, **k: None))


# --- a loss added in one place -----------------------------------------------------------
def _toy_loss(dit, batch, config, generator=None):
    raise AssertionError("not called: this test only wires the loss")


@pytest.fixture
def toy(monkeypatch):
    spec = LossSpec(name="toy", summary="a throwaway loss", fn=_toy_loss, default_optimizer="prodigy_sf")
    monkeypatch.setitem(LOSSES, spec.name, spec)
    return spec


def test_a_registered_loss_becomes_a_choice_and_passes_the_checks(toy):
    from diffsynth_qie.cli import build_parser
    from diffsynth_qie.commands.train import config_from_args

    assert "toy" in _choices("train") and "toy" in _choices("plan")
    cfg = config_from_args(build_parser().parse_args(
        ["train", "--cache_dir", "c", "--output_dir", "o", "--model", "tiny", "--loss", "toy"]))
    resolved = cfg.resolved(get_preset("tiny"))
    assert resolved.loss.loss == "toy" and resolved.optim.optimizer == "prodigy_sf"  # its own default optimizer
    assert registry.get_loss("toy") is _toy_loss and toy.config_of(resolved) is None  # no knobs, no flag group
    # its capabilities decide the checks: no stratified σ unless declared
    with pytest.raises(ValueError, match="--timestep_sampling stratified applies to --loss .*--loss toy"):
        _config("toy", timestep_sampling="stratified").resolved()
    assert _config("sft", timestep_sampling="stratified").resolved().timesteps.timestep_sampling == "stratified"


def test_capabilities_not_names_decide(monkeypatch):
    """A bridge loss is refused on a family without a bridge path and renders with the LBM sampler,
    whatever its name; a loss that declares stratified σ accepts it."""
    from diffsynth_qie.training.validation import Validator

    bridge = LossSpec(name="bridge2", summary="another bridge", fn=_toy_loss, bridge=True)
    strat = LossSpec(name="strat2", summary="another flow loss", fn=_toy_loss, stratified_sigma=True)
    for spec in (bridge, strat):
        monkeypatch.setitem(LOSSES, spec.name, spec)
    from diffsynth_qie.models.family import QWEN21
    from diffsynth_qie.models.family_ops import ops_for

    monkeypatch.setattr(type(ops_for(QWEN21)), "supports_lbm", False)  # a family without a bridge path
    with pytest.raises(ValueError, match="--loss bridge2 is a bridge .LBM. loss; --model tiny-2.1 is .* no bridge path"):
        _config("bridge2").resolved(get_preset("tiny-2.1"))
    assert _config("strat2", timestep_sampling="stratified").resolved().loss.loss == "strat2"

    class _Acc:
        @staticmethod
        def unwrap_model(m):
            return m

    validator = Validator.__new__(Validator)
    validator.accelerator = _Acc()
    for name, is_bridge in (("bridge2", True), ("strat2", False), *((n, loss_spec(n).bridge) for n in LOSSES)):
        module = type("M", (), {"config": _config(name)})()
        assert validator._objective(module)[0] is is_bridge, name

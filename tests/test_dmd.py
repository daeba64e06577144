"""--loss dmd (DMD2 few-step distillation of a task LoRA): the gradient against the paper's equation, the fake score's
update and the adapter switch (base and teacher untouched), exact kill-and-resume with the fake score in the
checkpoint, the student's declared schedule and teacher read back by `qie edit --scheduler auto`, --merge_teacher's
stacked file, the one-line refusals before anything loads, and the step on the fake device."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import fresh_accelerate, kill_and_resume  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def _teacher(path: Path, preset: str = "tiny", schedule: dict | None = None, dit=None) -> Path:
    """A rank-2 LoRA on to_q and img_mlp.net.2 of the tiny Edit DiT's blocks, large enough to move its output."""
    from safetensors.torch import save_file

    from diffsynth_qie.tiny.build import tiny_dit

    modules = dict((dit or tiny_dit()).named_modules())
    g = torch.Generator().manual_seed(5)
    tensors = {}
    for name in [n for n in modules if n.endswith(("attn.to_q", "img_mlp.net.2"))]:
        out_dim, in_dim = modules[name].weight.shape
        tensors[f"{name}.lora_A.weight"] = torch.randn(2, in_dim, generator=g) * 0.3
        tensors[f"{name}.lora_B.weight"] = torch.randn(out_dim, 2, generator=g) * 0.3
    metadata = {"preset": preset, **({"qie_schedule": json.dumps(schedule)} if schedule else {})}
    save_file(tensors, str(path), metadata=metadata)
    return path


# --- the equation ------------------------------------------------------------------------------------------------
def test_the_dmd_gradient_is_the_papers_equation():
    """DMD (Yin et al. 2024a, eq. 7-8; DMD2 keeps it): ∇ = w_t α_t (s_fake − s_real), s = −(x_t − α_t μ)/σ_t²,
    w_t = σ_t²/α_t · CS/‖μ_real − x‖₁, with flow matching's α_t = 1 − σ, σ_t = σ, μ = x_t − σ v; and the loss's
    gradient in x is that over the element count."""
    from diffsynth_qie.training.losses.dmd_math import dmd_gradient, dmd_loss

    g = torch.Generator().manual_seed(0)
    x, eps, v_real, v_fake = (torch.randn(3, 4, 5, 6, generator=g) for _ in range(4))
    sigma = torch.tensor([0.2, 0.5, 0.9])
    s, a = sigma.reshape(-1, 1, 1, 1), 1 - sigma.reshape(-1, 1, 1, 1)
    x_t = a * x + s * eps
    mu_real, mu_fake = x_t - s * v_real, x_t - s * v_fake
    score_real, score_fake = -(x_t - a * mu_real) / s ** 2, -(x_t - a * mu_fake) / s ** 2
    cs = x[0].numel()
    w = s ** 2 / a * cs / (mu_real - x).abs().sum((1, 2, 3), keepdim=True)
    paper = w * a * (score_fake - score_real)
    ours = dmd_gradient(x, x_t, v_real, v_fake, sigma)
    assert torch.allclose(ours, paper, rtol=1e-4, atol=1e-6)
    assert not torch.allclose(ours, -paper, atol=1e-3)  # (the sign matters: toward the teacher, away from the fake)
    leaf = x.clone().requires_grad_(True)
    dmd_loss(leaf, ours).sum().backward()
    assert torch.allclose(leaf.grad, ours / cs, rtol=1e-5, atol=1e-8)


def test_the_student_grid_is_fixed_and_declared():
    from diffsynth_qie.training.losses.dmd_math import student_sigmas

    assert student_sigmas(1) == (1.0,)
    four = student_sigmas(4)
    assert len(four) == 4 and four[0] == 1.0 and all(b < a for a, b in zip(four, four[1:])) and four[-1] > 0
    with pytest.raises(ValueError, match="--student_steps 9"):
        student_sigmas(9)


# --- the adapters ------------------------------------------------------------------------------------------------
def _module(tmp_path, **dmd):
    from diffsynth_qie.models.presets import get_preset
    from diffsynth_qie.tiny.build import tiny_dit
    from diffsynth_qie.training import config as tc
    from diffsynth_qie.training.losses.dmd import attach_fake_score
    from diffsynth_qie.training.module import QIETrainingModule

    teacher = _teacher(tmp_path / "teacher.safetensors")
    cfg = tc.RunConfig(train=tc.TrainConfig(cache_dir="c", output_dir="o", model="tiny", mixed_precision="no"),
                       lora=tc.LoRAConfig(lora_rank=4), loss=tc.LossConfig(loss="dmd"),
                       dmd=tc.DMDConfig(teacher_lora=str(teacher), **dmd)).resolved(get_preset("tiny"))
    torch.manual_seed(0)
    module = QIETrainingModule(tiny_dit(), cfg, "tiny")
    attach_fake_score(module, cfg, get_preset("tiny"), "cpu", torch.float32, None)
    return module, cfg


def test_adapters_switch_without_touching_the_base_or_the_teacher_and_the_fake_score_learns(tmp_path):
    from diffsynth_qie.training.losses.dmd_state import FAKE, active_adapter

    module, cfg = _module(tmp_path, dmd_fake_updates=3, dmd_fake_lr=1e-2)
    state, dit = module.loss_extras["dmd"], module.dit
    student = dict(module.trainable_named_parameters())
    assert student and not any(FAKE in n for n in student)  # the run's optimizer never sees the fake score
    layer = dit.transformer_blocks[0].attn.to_q
    with torch.no_grad():
        for p in list(student.values()) + state.params:
            p.normal_(0, 0.1)  # both adapters non-zero
    frozen = {n: t.detach().clone() for n, t in list(dit.named_parameters()) + list(dit.named_buffers())
              if "lora_" not in n or "qie_lora" in n}
    student_before = {n: p.detach().clone() for n, p in student.items()}
    x = torch.randn(2, layer.in_features, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        outs = {}
        for name in (None, "default", FAKE):
            with active_adapter(dit, name):
                outs[name] = layer(x)
        base_with_teacher = layer.base_layer(x)  # the base linear with the teacher's branch hooked on
    assert torch.equal(outs[None], base_with_teacher)
    assert not torch.allclose(outs["default"], outs[None]) and not torch.allclose(outs[FAKE], outs[None])
    assert not torch.allclose(outs["default"], outs[FAKE])
    assert layer.active_adapters == ["default"]  # switched back
    target = outs[None] + 1.0
    losses = [float(state.update_fake(lambda: ((layer(x) - target) ** 2).mean())) for _ in range(4)]
    assert losses[-1] < losses[0] and state.fake_steps == 12  # 3 updates per call
    after = dict(list(dit.named_parameters()) + list(dit.named_buffers()))
    assert all(torch.equal(after[n], t) for n, t in frozen.items())  # base and teacher: bit for bit
    assert all(torch.equal(p, student_before[n]) and p.grad is None for n, p in student.items())
    assert not any(p.requires_grad for p in state.params)


def test_a_fixed_noise_regression_reaches_the_student(tmp_path):
    """--dmd_regression_weight: the teacher's sample is made once per row and the student gets a gradient."""
    from diffsynth_qie.models.family_ops import ops_for
    from diffsynth_qie.training.losses.dmd_sample import Roles

    module, cfg = _module(tmp_path, dmd_fake_updates=1)
    g = torch.Generator().manual_seed(0)
    batch = {"target_latents": [torch.randn(16, 4, 4, generator=g)], "edit_latents": [[torch.randn(16, 4, 4, generator=g)]],
             "prompt_emb": [torch.randn(5, 32, generator=g)], "empty_prompt_emb": [torch.randn(3, 32, generator=g)],
             "entry_id": ["row"], "prompt_index": [0]}
    roles = Roles(module.dit, ops_for("qwen-image-edit"), batch, cfg, module.loss_extras["dmd"], g, student_steps=2,
                  teacher_cfg=4.0, sigma_range=(0.02, 0.98))
    roles.regression(0).backward()
    made = module.loss_extras["dmd"].teacher_samples["row/0"].clone()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for _, p in module.trainable_named_parameters())
    roles.regression(0)
    assert torch.equal(module.loss_extras["dmd"].teacher_samples["row/0"], made)  # made once


def test_validation_strips_show_the_teacher_beside_the_student(tmp_path, cache_dir, tiny_model_dir):
    """The teacher panel is the teacher as `qie edit` samples it (the base with the task LoRA, the student off, at
    --validation_steps and --teacher_cfg), rendered once; the student's panel beside it is its own and moves as the
    student trains."""
    import numpy as np

    from diffsynth_qie.cache.store import CacheStore
    from diffsynth_qie.training.losses.dmd_state import active_adapter
    from diffsynth_qie.training.validation import Validator, output_name
    from test_validation import ACCELERATOR, editor_flow_match, editor_for

    module, cfg = _module(tmp_path)
    student = dict(module.trainable_named_parameters())
    with torch.no_grad():
        for n, p in student.items():
            if "lora_B" in n:
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(2))
    store = CacheStore.open(cache_dir)
    zct, cpu = bool(cfg.train.zero_cond_t), torch.device("cpu")
    v = Validator(store, [0], str(tmp_path / "out"), "tiny", str(tiny_model_dir), 3, 1.0, zct, ACCELERATOR,
                  torch.float32)
    assert module.teacher_cfg == 4.0  # (the edit family's own CFG: --teacher_cfg unset)
    teacher = v.render(module, cpu, torch.float32, teacher_cfg=module.teacher_cfg)[0]
    entry = store.load(0)
    with active_adapter(module.dit, None):
        expected = editor_flow_match(editor_for(module.dit, zct), entry, 0, steps=3, cfg=4.0)
        wrong_cfg = editor_flow_match(editor_for(module.dit, zct), entry, 0, steps=3, cfg=1.0)
    with_student = editor_flow_match(editor_for(module.dit, zct), entry, 0, steps=3, cfg=4.0)
    assert torch.allclose(teacher.latents, expected, atol=1e-5, rtol=0)
    for wrong in (wrong_cfg, with_student):  # the comparison can fail
        assert float((teacher.latents - wrong).abs().max()) > 1e-3

    def panels(step):
        strip = np.asarray(v.run(step, module, cpu, torch.float32)[output_name(0, entry.entry_id)])
        n = len(entry.edit_latents) + 3  # references | target | teacher | student
        assert strip.shape[1] % n == 0
        w = strip.shape[1] // n
        return [strip[:, i * w:(i + 1) * w] for i in range(n)]

    first = panels(2)
    assert np.array_equal(first[-2], np.asarray(v.decoder.decode(expected)))
    assert not np.array_equal(first[-1], first[-2])
    with torch.no_grad():
        for n, p in student.items():
            if "lora_B" in n:
                p.mul_(-1.0)
    second = panels(4)
    assert np.array_equal(second[-2], first[-2]) and not np.array_equal(second[-1], first[-1])


# --- a run -------------------------------------------------------------------------------------------------------
def _train(tiny_model_dir, cache_dir, teacher, *extra):
    return [sys.executable, "-m", "diffsynth_qie.cli", "train", "--model", "tiny", "--model_dir", str(tiny_model_dir),
            "--cache_dir", str(cache_dir), "--loss", "dmd", "--teacher_lora", str(teacher), "--batch_size", "1",
            "--lora_rank", "4", "--learning_rate", "1e-3", "--mixed_precision", "no", "--device", "cpu",
            "--validate_every", "0", "--cfg_dropout", "0", "--dmd_fake_updates", "1", *extra]


def test_dmd_resumes_exactly_and_the_student_declares_its_schedule_and_teacher(tiny_model_dir, cache_dir, tmp_path):
    from safetensors.torch import load_file

    from diffsynth_qie.lora.frozen import stack_hint
    from diffsynth_qie.lora.stack import STACKED_KEY
    from diffsynth_qie.models.samplers.declared import plan_schedule, read_metadata
    from diffsynth_qie.training.losses.dmd_math import student_sigmas

    teacher = _teacher(tmp_path / "teacher.safetensors")
    base = _train(tiny_model_dir, cache_dir, teacher, "--student_steps", "2", "--max_steps", "4", "--save_every", "2",
                  "--merge_teacher")
    ref, out = kill_and_resume(base, tmp_path, "checkpoint-2", "lora.safetensors")
    a, b = load_file(str(out / "lora.safetensors")), load_file(str(ref / "lora.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(a[k].abs().sum() > 0 for k in a if "lora_B" in k) and not any("dmd_fake" in k for k in a)
    rows = [[json.loads(line) for line in (d / "loss.jsonl").read_text().splitlines() if '"loss"' in line]
            for d in (ref, out)]
    # the fake score's loss after the resume: its weights and its optimizer came back with the checkpoint
    assert [(r["loss"], r["fake_loss"]) for r in rows[1][-2:]] == [(r["loss"], r["fake_loss"]) for r in rows[0][-2:]]
    # what qie edit / eval-edits / the UI read: the declared schedule (--scheduler auto) and the teacher to stack
    plan = plan_schedule("auto", None, None, [out / "lora.safetensors"], "qwen-image-edit", 40, 4.0)
    assert (plan.steps, plan.cfg, plan.sigmas) == (2, 1.0, student_sigmas(2))
    assert stack_hint([out / "lora.safetensors"]) == [(str(teacher.resolve()), 1.0)]
    merged = read_metadata(out / "lora_merged.safetensors")
    assert json.loads(merged[STACKED_KEY])["file"] == teacher.name and "qie_trained_on" not in merged
    assert plan_schedule("auto", None, None, [out / "lora_merged.safetensors"], "qwen-image-edit", 40,
                         4.0).sigmas == student_sigmas(2)


def test_the_stacked_file_adds_the_two_deltas(tmp_path):
    from diffsynth_qie.lora.formats import load_lora_state
    from diffsynth_qie.lora.stack import stack_states
    from diffsynth_qie.lora.state import LoraModule, LoraState

    g = torch.Generator().manual_seed(0)
    one = LoraModule(A=torch.randn(2, 6, generator=g), B=torch.randn(5, 2, generator=g), alpha=1.0)
    two = LoraModule(A=torch.randn(3, 6, generator=g), B=torch.randn(5, 3, generator=g))
    only = LoraModule(A=torch.randn(1, 6, generator=g), B=torch.randn(5, 1, generator=g))
    stacked = stack_states([(LoraState({"m": one, "n": only}), 0.5), (LoraState({"m": two}), 1.0)])
    assert torch.allclose(stacked.modules["m"].delta(), 0.5 * one.delta() + two.delta(), atol=1e-6)
    assert torch.allclose(stacked.modules["n"].delta(), 0.5 * only.delta(), atol=1e-6)
    with pytest.raises(ValueError, match="full weights do not add"):
        stack_states([(LoraState({}, full={"w": torch.ones(1)}), 1.0), (LoraState({}, full={"w": torch.ones(1)}), 1.0)])
    assert load_lora_state  # (the file form is read back in the run test above)


@pytest.mark.parametrize("case,message", [
    ("none", "--loss dmd needs --teacher_lora FILE"),
    ("missing", "is not a file"),
    ("family", "is for qwen-image-2.1, but --model is qwen-image-edit"),
    ("fewstep", "is already a few-step LoRA"),
    ("steps", "--student_steps"),
])
def test_dmd_refuses_bad_input_in_one_line_before_anything_loads(tiny_model_dir, cache_dir, tmp_path, capsys, case,
                                                                 message):
    from diffsynth_qie.cli import main

    teachers = {"none": None, "missing": tmp_path / "nope.safetensors", "family":
                _teacher(tmp_path / "t21.safetensors", preset="tiny-2.1"),
                "fewstep": _teacher(tmp_path / "fast.safetensors",
                                    schedule={"version": 1, "steps": 4, "cfg": 1.0, "shift": 3.0}),
                "steps": _teacher(tmp_path / "t.safetensors")}
    argv = _train(tiny_model_dir, cache_dir, teachers[case] or "", "--max_steps", "1", "--output_dir",
                  str(tmp_path / "o"))[3:]
    if case == "none":
        argv = [a for a in argv if a not in ("--teacher_lora", "")]
    if case == "steps":
        argv += ["--student_steps", "9"]
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own refusal
        code = e.code
    err = capsys.readouterr().err
    assert code != 0 and message in err
    assert not (tmp_path / "o" / "loss.jsonl").exists()


def test_zero3_is_refused_before_the_load():
    from diffsynth_qie.training.losses.registry import loss_spec

    with pytest.raises(ValueError, match="--loss dmd does not run under DeepSpeed ZeRO-3"):
        loss_spec("dmd").check_launch(None, {"zero_optimization": {"stage": 3}})


@pytest.mark.parametrize("model,teacher_cfg", [("2511", None), ("2.1", 4.0)])
def test_the_dmd_step_runs_on_the_fake_device(tmp_path, model, teacher_cfg):
    """Both adapters, the teacher's CFG pass and the fake score's own step (its backward, its AdamW state), and the
    validation render of the student and of the teacher beside it, on the 2511 DiT and on 2.1's (its references in
    the prefix, the negative's slot mask), 1 block, 256²."""
    from diffsynth_qie.memory.census import build_dit
    from diffsynth_qie.models.presets import get_preset
    from diffsynth_qie.preflight.train_step import batch_shapes, verify_train_step
    from diffsynth_qie.training import config as tc
    from diffsynth_qie.training.module import QIETrainingModule

    preset = get_preset(model)
    with torch.device("meta"):
        dit = build_dit(preset, 1)
    teacher = _teacher(tmp_path / "teacher.safetensors", preset=model, dit=dit)
    cfg = tc.RunConfig(train=tc.TrainConfig(cache_dir="-", output_dir="-", model=model, validate_every=10),
                       loss=tc.LossConfig(loss="dmd"),
                       dmd=tc.DMDConfig(teacher_lora=str(teacher), student_steps=1, dmd_fake_updates=1,
                                        teacher_cfg=teacher_cfg))
    cfg = cfg.resolved(preset)
    shapes = batch_shapes(256, 1, 40, 1, multiple=32 if model == "2.1" else 16)
    report = verify_train_step(cfg, preset, shapes, num_layers=1)
    trainable = 4 * sum(p.numel() for p in QIETrainingModule(dit, cfg, model).trainable_modules())  # fp32 bytes
    assert report.notes == [] and report.weights >= 2 * trainable  # the fake score's adapter beside the student's
    assert report.validation_peak > 0
    assert report.optimizer_state > 3 * trainable  # beyond the run's AdamW state (2x): the fake score's


def test_qie_plan_counts_the_teacher_the_fake_score_and_its_step():
    import argparse

    from diffsynth_qie.cli import build_parser
    from diffsynth_qie.commands.plan import options_of
    from diffsynth_qie.memory.census import preset_census
    from diffsynth_qie.memory.plan import predict

    def plan(loss):
        args = build_parser().parse_args(["plan", "--model", "2511", "--loss", loss, "--resolution", "1024"])
        assert isinstance(args, argparse.Namespace)
        return predict(preset_census("2511"), options_of(args))

    census = preset_census("2511")
    n = census.lora_params(32)
    sft, dmd = plan("sft"), plan("dmd")
    extra = {k: v for k, v in dmd.gpu.items() if k not in sft.gpu}
    assert extra["teacher LoRA (frozen branches, bf16)"] == 2 * n
    assert extra["fake score LoRA + its AdamW state (fp32)"] == 12 * n
    assert extra["fake score gradients (its own step)"] == 4 * n
    assert sum(dmd.gpu.values()) - sum(sft.gpu.values()) == sum(extra.values())


def test_export_lora_states_the_students_schedule_in_its_log(tmp_path, capfd):
    from diffsynth_qie.cli import main

    schedule = {"version": 1, "steps": 2, "cfg": 1.0, "sigmas": [1.0, 0.5]}
    student = _teacher(tmp_path / "student.safetensors", schedule=schedule)
    assert main(["export-lora", "--format", "comfyui", str(student), str(tmp_path / "out.safetensors")]) == 0
    err = capfd.readouterr().err
    assert "declares its sampling schedule (its metadata): 2 sigmas 1, 0.5, CFG 1. comfyui does not read it" in err, err
    assert main(["export-lora", "--format", "comfyui", str(_teacher(tmp_path / "task.safetensors")),
                 str(tmp_path / "out2.safetensors")]) == 0
    assert "declares its sampling schedule" not in capfd.readouterr().err

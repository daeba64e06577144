"""``--loss dpo``: Diffusion-DPO for flow matching against a direct implementation of its equation, its limits
(log 2 when the policy is the reference, no gradient from a pair whose two outputs are the same), a toy that
learns the preference, the preference rows (the ``rejected`` column, identical pairs refused), the cache's
``rejected_latents`` and an exact resume after kill -9 on the tiny model."""
from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

from conftest import kill_and_resume  # noqa: E402
from diffsynth_qie.models.presets import get_preset
from diffsynth_qie.training.config import DPOConfig, LossConfig, RunConfig, TrainConfig

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def _config(beta: float = 50.0, **loss) -> RunConfig:
    return RunConfig(train=TrainConfig(cache_dir="c", output_dir="o", model="tiny"), loss=LossConfig(loss="dpo", **loss),
                     dpo=DPOConfig(dpo_beta=beta)).resolved(get_preset("tiny"))


# --- a toy "DiT": one linear layer over the channels with a PEFT LoRA on it -------------------------
class _Toy(torch.nn.Module):
    def __init__(self, channels: int = 4):
        super().__init__()
        self.proj = torch.nn.Linear(channels, channels)

    def forward(self, x):  # [C, h, w] -> [C, h, w]
        return self.proj(x.permute(1, 2, 0)).permute(2, 0, 1)


def _toy(seed: int = 0, lora_b: float = 0.0):
    from peft import LoraConfig, inject_adapter_in_model

    torch.manual_seed(seed)
    model = inject_adapter_in_model(LoraConfig(r=2, lora_alpha=2, target_modules=["proj"]), _Toy())
    if lora_b:
        torch.nn.init.normal_(model.proj.lora_B["default"].weight, std=lora_b)
    return model


@pytest.fixture
def toy_forward(monkeypatch):
    """The family's DiT call replaced by the toy's (the loss's own code paths stay as they are)."""
    from diffsynth_qie.models.family_ops import ops_for

    ops = ops_for(get_preset("tiny").family)

    def forward(dit, latents, timesteps, prompts, ref_latents, zero_cond_t=False, use_gradient_checkpointing=False):
        assert len(latents) == len(timesteps) == len(prompts) == len(ref_latents)
        return [dit(x) for x in latents]

    monkeypatch.setattr(type(ops), "forward", staticmethod(forward))


def _batch(n: int = 3, seed: int = 1, same: bool = False) -> dict:
    g = torch.Generator().manual_seed(seed)
    chosen = [torch.randn(4, 2, 3, generator=g) for _ in range(n)]
    rejected = [c.clone() if same else torch.randn(4, 2, 3, generator=g) for c in chosen]
    return {"target_latents": chosen, "rejected_latents": rejected, "prompt_emb": [torch.zeros(2, 8)] * n,
            "edit_latents": [[torch.zeros(4, 2, 3)]] * n, "back_mask": [None] * n, "entry_id": [f"r{i}" for i in range(n)]}


@torch.no_grad()
def _direct(model, batch, config, seed: int) -> float:
    """The equation written out: per sample one σ and one ε for both images, e = mean((v_θ(x_σ) − (ε − x0))²),
    the reference with the LoRA's product left out by hand, L = log(1 + exp(β/2 · Δ)), weighted mean."""
    from diffsynth_qie.models.family_ops import ops_for
    from diffsynth_qie.training.timesteps import draw_timesteps

    g = torch.Generator().manual_seed(seed)
    beta, family = config.dpo.dpo_beta, ops_for(get_preset("tiny").family).family
    lin = model.proj
    w0, b0 = lin.base_layer.weight, lin.base_layer.bias
    delta = lin.lora_B["default"].weight @ lin.lora_A["default"].weight * lin.scaling["default"]
    total = 0.0
    for xw, xl in zip(batch["target_latents"], batch["rejected_latents"]):
        d = draw_timesteps(1, config.timesteps, g, weighting=config.loss.loss_weighting, family=family)
        eps = torch.randn(xw.shape, generator=g)
        s = float(d.sigmas[0])
        err = {}
        for name, x0 in (("w", xw), ("l", xl)):
            xt = ((1 - s) * x0 + s * eps).permute(1, 2, 0)
            for who, weight in (("theta", w0 + delta), ("ref", w0)):
                v = (xt @ weight.T + b0).permute(2, 0, 1)
                err[who, name] = float(((v - (eps - x0)) ** 2).mean())
        inside = beta / 2 * ((err["theta", "w"] - err["ref", "w"]) - (err["theta", "l"] - err["ref", "l"]))
        total += float(d.weights[0]) * math.log1p(math.exp(inside))
    return total / len(batch["target_latents"])


def test_the_loss_is_the_equation(toy_forward):
    from diffsynth_qie.training.losses.dpo import flow_dpo_loss

    config, model, batch = _config(), _toy(lora_b=0.5), _batch()
    loss, metrics = flow_dpo_loss(model, batch, config, torch.Generator().manual_seed(3))
    assert float(loss.detach()) == pytest.approx(_direct(model, batch, config, seed=3), rel=1e-5)
    assert float(loss) != pytest.approx(math.log(2) * metrics["weight_mean"], rel=1e-3)  # the LoRA moved it
    assert 0.0 <= float(metrics["dpo_accuracy"]) <= 1.0 and math.isfinite(float(metrics["dpo_margin"]))
    assert not model.proj.disable_adapters  # the LoRA is back on after the reference pass


def test_a_batch_is_its_samples(toy_forward):
    """Per-sample σ and ε: a batch of 2 gives the mean of the two samples alone (equal weights)."""
    from diffsynth_qie.training.losses.dpo import flow_dpo_loss

    config, model, batch = _config(loss_weighting="none"), _toy(lora_b=0.5), _batch(n=2)
    whole, _ = flow_dpo_loss(model, batch, config, torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(5)
    parts = [flow_dpo_loss(model, {k: v[i:i + 1] for k, v in batch.items()}, config, g)[0] for i in range(2)]
    assert float(whole) == pytest.approx(float(sum(parts)) / 2, rel=1e-6)


def test_policy_equal_to_reference_gives_log2(toy_forward):
    from diffsynth_qie.training.losses.dpo import dpo_terms, flow_dpo_loss

    config = _config(loss_weighting="none")
    loss, metrics = flow_dpo_loss(_toy(lora_b=0.0), _batch(), config, torch.Generator().manual_seed(0))
    assert float(loss) == pytest.approx(math.log(2), abs=1e-7) and float(metrics["dpo_margin"]) == 0.0
    e = torch.rand(5)
    assert torch.allclose(dpo_terms(e, e.flip(0), e, e.flip(0), 5000.0)[0], torch.full((5,), math.log(2)))


def test_a_pair_of_identical_outputs_gives_no_gradient(toy_forward):
    """Why such rows are refused: with the same image as chosen and rejected the margin is 0 whatever the
    weights, so the loss is log 2 and its gradient is zero (to rounding: the two halves' terms cancel), a
    million times smaller than a real pair's."""
    from diffsynth_qie.training.losses.dpo import flow_dpo_loss

    def grad_norm(same: bool) -> tuple[float, float]:
        model = _toy(lora_b=0.5)
        loss, _ = flow_dpo_loss(model, _batch(same=same), _config(loss_weighting="none"), torch.Generator().manual_seed(0))
        loss.backward()
        grads = [p.grad for n, p in model.named_parameters() if "lora_" in n and p.grad is not None]
        return float(loss.detach()), float(torch.cat([g.flatten() for g in grads]).norm())

    (loss, same), (_, different) = grad_norm(True), grad_norm(False)
    assert loss == pytest.approx(math.log(2), abs=1e-7)
    assert different > 1e-3 and same < 1e-6 * different


def test_steps_lower_the_loss_on_a_toy(toy_forward, capsys):
    from diffsynth_qie.training.losses.dpo import flow_dpo_loss

    config, model, batch = _config(beta=200.0, loss_weighting="none"), _toy(lora_b=0.0), _batch(n=4)
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses, accuracy = [], []
    for _ in range(30):
        loss, metrics = flow_dpo_loss(model, batch, config, torch.Generator().manual_seed(0))
        losses.append(float(loss))
        accuracy.append(float(metrics["dpo_accuracy"]))
        opt.zero_grad()
        loss.backward()
        opt.step()
    with capsys.disabled():
        print(f"\ntoy DPO loss {losses[0]:.4f} -> {losses[-1]:.2e}, implicit accuracy {accuracy[0]:.2f} -> {accuracy[-1]:.2f}")
    assert losses[0] == pytest.approx(math.log(2), abs=1e-7)
    assert losses[-1] < 0.5 * losses[0] and accuracy[-1] == 1.0


def test_a_row_without_a_rejected_image_is_refused(toy_forward):
    from diffsynth_qie.training.losses.dpo import flow_dpo_loss

    batch = _batch(n=2)
    batch["rejected_latents"] = [batch["rejected_latents"][0], None]
    with pytest.raises(ValueError, match="entry 'r1' has no rejected image.*PREFERENCE.md.*re-run `qie cache`"):
        flow_dpo_loss(_toy(), batch, _config())
    with pytest.raises(ValueError, match="needs a LoRA: pass --lora_rank"):
        flow_dpo_loss(_Toy(), _batch(n=1), _config())
    with pytest.raises(ValueError, match="--dpo_beta must be > 0"):
        DPOConfig(dpo_beta=0)


# --- preference rows and their cache ----------------------------------------------------------------
def _preference_data(root: Path, identical: bool = False) -> Path:
    """The demo data with a ``rejected`` column: the unedited source (a no-op edit) is the rejected output;
    with ``identical`` the last row's rejected image is a copy of its target."""
    from diffsynth_qie.data.demo import make_demo_data

    data = make_demo_data(root, num_pairs=4, seed=3, mixed_sizes=True)
    rows = json.loads((data / "metadata.json").read_text())
    for row in rows:
        row["rejected"] = row["edit_image"][0]
    if identical:
        shutil.copy(data / rows[-1]["image"], data / "copy_of_target.png")
        rows[-1]["rejected"] = "copy_of_target.png"
    (data / "metadata.json").write_text(json.dumps(rows))
    return data


def test_a_pair_with_identical_images_is_refused_naming_file_row_and_fix(tmp_path, caplog):
    from diffsynth_qie.data.formats import prepare_rows

    data = _preference_data(tmp_path / "data", identical=True)
    good, skipped = prepare_rows(data / "metadata.json", max_bad_fraction=0.5)
    assert [r.rejected is not None for r in good] == [True] * 3
    assert [(s.row_id, s.field, Path(s.path).name) for s in skipped] == [("data:3", "rejected", "copy_of_target.png")]
    line = next(r.getMessage() for r in caplog.records if "copy_of_target" in r.getMessage())
    assert "data:3" in line and "same pixels" in line and "drop the row" in line
    with pytest.raises(ValueError, match="rejected: the rejected image has the same pixels"):
        prepare_rows(data / "metadata.json", max_bad_fraction=0.0)


@pytest.fixture(scope="module")
def preference_cache(tiny_model_dir, tmp_path_factory):
    from diffsynth_qie.cache.writer import CacheConfig, write_cache
    from diffsynth_qie.data.formats import DatasetConfig

    data = _preference_data(tmp_path_factory.mktemp("pref-data"))
    out = tmp_path_factory.mktemp("pref-cache")
    write_cache(CacheConfig(cache_dir=str(out), model="tiny", model_dir=str(tiny_model_dir), max_pixels=128 * 128,
                            num_workers=1, device="cpu", dtype="float32",
                            dataset=DatasetConfig(dataset_metadata=str(data / "metadata.json"))), rank=0, world_size=1)
    return out


def test_the_cache_holds_the_rejected_latents_at_the_targets_size(preference_cache):
    from diffsynth_qie.cache.store import CacheStore

    store = CacheStore.open(preference_cache)
    assert len(store) == 4
    for i in range(len(store)):
        entry, meta = store.load(i), store.meta(i)
        assert meta.rejected_shape == meta.target_shape == tuple(entry.rejected_latents.shape)
        assert not torch.equal(entry.rejected_latents, entry.target_latents)


def test_rows_without_a_rejected_image_are_refused_before_anything_loads(preference_cache, cache_dir, tmp_path,
                                                                        capfd):
    """A preference cache beside a cache of plain rows: ``--loss dpo`` stops at the start, before the DiT loads
    (its --model_dir does not even exist) and before the first step, naming the rows, their metadata file and the
    fix; nothing is left behind."""
    from conftest import fresh_accelerate

    from diffsynth_qie.cache.store import CacheStore
    from diffsynth_qie.cli import main

    plain = CacheStore.open(cache_dir)
    out = tmp_path / "run"
    with fresh_accelerate():
        code = main(["train", "--model", "tiny", "--model_dir", str(tmp_path / "no-model"), "--cache_dir",
                     str(preference_cache), str(cache_dir), "--loss", "dpo", "--max_steps", "2", "--device", "cpu",
                     "--lora_rank", "4", "--no_preflight", "--output_dir", str(out)])
    err = capfd.readouterr().err
    line = next((x for x in err.splitlines() if "no rejected image" in x), "")
    assert code == 2 and not out.exists(), err
    assert f"{len(plain)} of {len(plain) + 4} training rows have no rejected image" in line
    assert plain.meta(0).row_id in line and plain.manifest["metadata"] in line and str(cache_dir) in line
    assert "docs/PREFERENCE.md" in line and "re-run `qie cache`" in line and "--loss sft" not in line


def test_dpo_training_resumes_exactly_after_a_kill(preference_cache, tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    base = [sys.executable, "-m", "diffsynth_qie.cli", "train", "--model", "tiny", "--model_dir", str(tiny_model_dir),
            "--cache_dir", str(preference_cache), "--loss", "dpo", "--dpo_beta", "500", "--batch_size", "2",
            "--max_steps", "6", "--save_every", "2", "--mixed_precision", "no", "--device", "cpu",
            "--lora_rank", "4", "--learning_rate", "1e-3", "--no_preflight"]
    # the one kill-and-resume test whose killed run is a fresh `python -m diffsynth_qie.cli train` process
    ref, out = kill_and_resume(base, tmp_path, "checkpoint-2", "lora.safetensors", separate=True)
    a, b = load_file(str(out / "lora.safetensors")), load_file(str(ref / "lora.safetensors"))
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-6, atol=1e-8) for k in a)
    records = [[json.loads(line) for line in (d / "loss.jsonl").read_text().splitlines() if '"loss"' in line]
               for d in (ref, out)]
    assert [r["loss"] for r in records[1][-2:]] == pytest.approx([r["loss"] for r in records[0][-2:]], rel=1e-6)
    first = records[0][0]  # the LoRA starts at zero: the policy is the reference, each sample's loss is log 2
    assert first["loss"] == pytest.approx(math.log(2) * first["weight_mean"], rel=1e-4)
    assert {"dpo_accuracy", "dpo_margin"} <= set(first)


# --- qie plan and the fake-device step ------------------------------------------------------------------
def test_the_plan_counts_two_samples_and_the_reference_pass():
    from diffsynth_qie.memory.census import preset_census
    from diffsynth_qie.memory.plan import PlanOptions, predict

    census = preset_census("2511")
    sft, dpo = (predict(census, PlanOptions(resolution=512, pairs=p)) for p in (False, True))
    assert dpo.gpu["activations"] == 2 * sft.gpu["activations"]
    assert 0 < dpo.gpu["reference forward (no graph)"] < sft.gpu["activations"]
    assert dpo.gpu_peak > sft.gpu_peak


def test_the_fake_device_runs_a_dpo_step_with_the_reference_pass():
    import dataclasses

    from diffsynth_qie.training.config import RunConfig
    from diffsynth_qie.preflight.train_step import batch_shapes, verify_train_step

    def step(loss: str):
        cfg = RunConfig()
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, model="2511", cache_dir="-", output_dir="-"),
                                  loss=dataclasses.replace(cfg.loss, loss=loss)).resolved(get_preset("2511"))
        return verify_train_step(cfg, get_preset("2511"), batch_shapes(512, 1, 40, 1), num_layers=1)

    sft, dpo = step("sft"), step("dpo")
    assert dpo.notes == [] and dpo.loss_dtype == sft.loss_dtype
    assert dpo.forward_backward_peak > 1.5 * (sft.forward_backward_peak - sft.weights) + sft.weights


def test_make_dataset_builds_preference_rows_from_two_folders(tmp_path):
    """--target holds the chosen outputs, --rejected the rejected ones, matched by stem; the rows read back with
    their rejected image, and the pair whose rejected image is the chosen one again is refused at cache time."""
    from PIL import Image

    from diffsynth_qie.cli import build_parser
    from diffsynth_qie.data.formats import prepare_rows

    for key, colour in (("a", (10, 10, 250)), ("b", (10, 250, 10)), ("c", (250, 10, 10)), ("d", (9, 9, 9))):
        for folder, c in (("source", (128, 128, 128)), ("chosen", colour), ("rejected", (128, 128, 128))):
            (tmp_path / folder).mkdir(exist_ok=True)
            if (folder, key) != ("rejected", "d"):  # d has no rejected image: not a preference row
                Image.new("RGB", (64, 48), colour if (folder, key) == ("rejected", "c") else c).save(
                    tmp_path / folder / f"{key}.png")
    out = tmp_path / "meta" / "metadata.jsonl"
    args = build_parser().parse_args(["make-dataset", "--target", str(tmp_path / "chosen"), "--source",
                                      str(tmp_path / "source"), "--rejected", str(tmp_path / "rejected"),
                                      "--prompt", "make it colourful", "--out", str(out), "--workers", "0"])
    assert args._run(args) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [Path(r["rejected"]).name for r in records] == ["a.png", "b.png", "c.png"]  # d is not written
    (skipped_d,) = [json.loads(line) for line in Path(f"{out}.skipped.jsonl").read_text().splitlines()]
    assert (skipped_d["row_id"], skipped_d["field"]) == ("d", "rejected") and "--rejected" in skipped_d["reason"]
    good, skipped = prepare_rows(out, max_bad_fraction=0.5)
    assert [(r.row_id, r.rejected.resolve()) for r in good] == [
        (f"meta:{i}", (tmp_path / "rejected" / f"{k}.png").resolve()) for i, k in enumerate("ab")]
    assert [(s.row_id, s.field) for s in skipped] == [("meta:2", "rejected")]
    with pytest.raises(ValueError, match="--rejected .* is the --target folder itself"):
        args = build_parser().parse_args(["make-dataset", "--target", str(tmp_path / "chosen"), "--source",
                                          str(tmp_path / "source"), "--rejected", str(tmp_path / "chosen"),
                                          "--prompt", "p", "--out", str(out), "--workers", "0"])
        args._run(args)


def test_check_dataset_refuses_an_identical_pair_in_one_line(tmp_path, caplog):
    from diffsynth_qie.cli import build_parser

    data = _preference_data(tmp_path / "data", identical=True)
    args = build_parser().parse_args(["check-dataset", str(data / "metadata.json"), "--out", str(tmp_path / "check"),
                                      "--workers", "0"])
    assert args._run(args) == 0
    lines = [r.getMessage() for r in caplog.records if "copy_of_target.png" in r.getMessage()]
    assert lines and "skipping row data:3: rejected:" in lines[0] and "drop the row" in lines[0]
    flagged = [json.loads(line)["row_id"] for line in (tmp_path / "check" / "check.jsonl").read_text().splitlines()]
    assert "data:3" not in flagged  # refused before it is measured

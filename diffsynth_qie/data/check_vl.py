"""``qie check-dataset --vl_check DIR``: each edit scored against its instruction by a vision-language model.

The model is the family's own prompt encoder: Qwen-Image-Edit's text encoder is a whole Qwen2.5-VL (its language
head included), so it can answer about two images; Qwen-Image-2.1's Qwen3-VL is read the same way. It is asked
whether the second image is the first edited as the instruction says; ``P(yes)`` against ``P(no)`` is the score,
and a row under ``threshold`` gets ``instruction_mismatch`` (a warning: a small model's opinion). Off by default:
a 7 B model wants a GPU. The folder is checked before anything loads (``config.json`` naming a VL architecture,
safetensors weights, a processor), so a wrong folder is refused at once, before the dataset is measured.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Sequence

log = logging.getLogger(__name__)

ARCHITECTURES = ("Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration")
QUESTION = ("Picture 1 is a photo before an edit and picture 2 the same photo after it. The edit instruction was: "
            "\"{instruction}\". Does picture 2 show picture 1 edited as the instruction says? Answer yes or no.")


def check_folder(folder: str | Path) -> Path:
    """``folder`` if it holds a VL model this check can ask; else a ValueError naming what is missing."""
    path = Path(folder).expanduser()
    hint = ("give the model's text encoder folder (e.g. Qwen-Image-Edit-2509/text_encoder, with its processor "
            "beside it)")
    if not path.is_dir():
        raise ValueError(f"--vl_check {folder}: no such folder; {hint}")
    config = path / "config.json"
    if not config.is_file():
        raise ValueError(f"--vl_check {folder}: no config.json in it; {hint}")
    try:
        arch = json.loads(config.read_text()).get("architectures") or []
    except (json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"--vl_check {folder}: config.json is not a model config ({e}); {hint}") from e
    if not any(a in ARCHITECTURES for a in arch):
        raise ValueError(f"--vl_check {folder}: its architecture {arch} cannot look at images; it must be one of "
                         f"{list(ARCHITECTURES)}")
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"--vl_check {folder}: no *.safetensors weights in it (download the model's text_encoder "
                         f"weights first); {hint}")
    return path


def processor_folder(path: Path) -> Path:
    """Where the processor (tokenizer + image processor) is: beside the weights or in ``../processor``."""
    for candidate in (path, path.parent / "processor", path.parent / "tokenizer"):
        if (candidate / "preprocessor_config.json").is_file() or (candidate / "tokenizer_config.json").is_file():
            return candidate
    raise ValueError(f"--vl_check {path}: no processor (preprocessor_config.json / tokenizer_config.json) in it "
                     f"or in {path.parent / 'processor'}; copy the model's processor folder beside it")


def _load_model(path: Path, processor: Path):
    """The weights themselves (the one expensive step; the folder was checked before)."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForImageTextToText.from_pretrained(
        path, torch_dtype=torch.bfloat16 if device == "cuda" else torch.float32).to(device).eval()
    return model, AutoProcessor.from_pretrained(processor)


class VLJudge:
    def __init__(self, model, processor, threshold: float = 0.5):
        self.model, self.processor, self.threshold = model, processor, threshold

    @classmethod
    def load(cls, folder: str | Path, threshold: float = 0.5) -> "VLJudge":
        path = check_folder(folder)
        proc = processor_folder(path)
        log.info("--vl_check: loading %s (the processor from %s)", path, proc)
        return cls(*_load_model(path, proc), threshold=threshold)

    def score(self, source, target, instruction: str) -> float:
        """P(yes) / (P(yes) + P(no)) for the question about this pair."""
        import torch

        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                                 {"type": "text", "text": QUESTION.format(instruction=instruction)}]}]
        text = self.processor.apply_chat_template(messages, add_generation_prompt=True)
        inputs = self.processor(text=[text], images=[source, target], return_tensors="pt").to(self.model.device)
        with torch.no_grad():
            logits = self.model(**inputs).logits[0, -1].float()
        tok = self.processor.tokenizer
        yes, no = (tok.encode(w, add_special_tokens=False)[0] for w in ("yes", "no"))
        return float(torch.softmax(logits[[yes, no]], 0)[0])

    def flag_rows(self, checks: Sequence) -> None:
        """``instruction_mismatch`` on each measured pair without an error whose score is under the threshold."""
        from .check_rules import flag
        from .images import load_rgb

        for c in checks:
            instruction = c.measures.get("_instruction")
            if not instruction or not c.paths.get("source") or c.severity() == "error":
                continue
            p = self.score(load_rgb(c.paths["source"]), load_rgb(c.paths["target"]), instruction)
            c.measures["instruction_score"] = round(p, 3)
            if p < self.threshold:
                flag(c, "instruction_mismatch", round(p, 3), f"the VL model doubts the edit follows the instruction "
                     f"(P(yes) {p:.2f} < {self.threshold})", 1.0 - p)

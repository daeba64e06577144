"""The web UI's settings, one typed dataclass turned into ``app_gradio.py``'s flags.

Pure data (no gradio, no torch), so ``python app_gradio.py --help`` stays fast.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..models.preset_flags import preset_help, preset_type
from ..models.presets import DEFAULT_MAX_PROMPT_TOKENS
from ..utils.config_cli import cli_help


@dataclass
class UIConfig:
    """Mask-edit web UI (app_gradio.py)."""

    host: str = field(default="127.0.0.1", metadata={
        "help": "interface to bind; the default keeps the UI on this machine (use 0.0.0.0 to expose it)"})
    port: int = field(default=7999, metadata={"help": "HTTP port", "unbounded": True})
    share: bool = field(default=False, metadata={
        "help": "also open a public gradio.live tunnel (opt-in: anyone with the link can use your GPU)"})
    model: str = field(default="tiny", metadata=cli_help(preset_help(), type=preset_type(), metavar="PRESET"))
    model_dir: str | None = field(default=None, metadata={
        "help": "local directory holding the model in its repo layout; for the tiny preset it is "
                "built there if missing (default: the preset's usual location; for tiny the pretrained tiny base "
                "in $QIE_HOME/models/Qwen-Image-Edit-tiny-pretrained, installed on first use)"})
    lora_dir: str = field(default="./outputs", metadata={
        "help": "folder searched (recursively) for *.safetensors LoRAs; the training scripts' "
                "OUTPUT_DIR default"})
    lightning_lora: str | None = field(default=None, metadata={
        "help": "Lightning few-step LoRA (e.g. Qwen-Image-Edit-2509-Lightning-8steps-V1.0-bf16.safetensors) "
                "that the 'Lightning (4 / 8 steps)' sampler stacks with the chosen LoRA"})
    lora: str | None = field(default=None, metadata={
        "help": "LoRA picked at start, as a name inside --lora_dir (default: the folder's own lora.safetensors "
                "when it has one, as a training run's output folder does)"})
    examples: str = field(default="auto", metadata={
        "help": "dataset metadata file (JSON, JSONL or CSV, as `qie cache` reads) whose rows become clickable "
                "examples (image, mask, prompt); auto = the CPU demo's held-out rows; '' = none"})
    outputs_dir: str = field(default="./outputs/ui-edits", metadata={
        "help": "where every result is kept, one folder per Generate (its input, mask, reference images and the "
                "result PNGs with their settings and command); the history is rebuilt from it on start and reload"})
    max_upload_mb: float = field(default=50.0, metadata={
        "help": "refuse (with a message) any image file larger than this many megabytes as it reaches "
                "the server; the image editor sends its canvas as PNG, often larger than the file picked",
                "unbounded": True})
    max_prompt_tokens: int = field(default=DEFAULT_MAX_PROMPT_TOKENS, metadata={
        "help": "refuse (with a message) prompts longer than this many tokens", "min": 1, "max": 1 << 20})
    temp_dir: str | None = field(default=None, metadata={
        "help": "where the UI keeps its temporary files (uploads, outputs served for download): in its own "
                "subfolder diffsynth-qie-ui-<port>, emptied at startup (default: the system's temp folder)"})
    max_temp_mb: float = field(default=500.0, metadata={
        "help": "keep the UI's temporary files under this many megabytes; the oldest are removed first",
        "unbounded": True})
    device: str | None = field(default=None, metadata={
        "help": "torch device (default: cuda if available, else cpu)"})
    text_encoder_device: str | None = field(default=None, metadata={"help": "device of the text encoder (default: --device)"})
    vae_device: str | None = field(default=None, metadata={"help": "device of the VAE (default: --device)"})
    dit_device: str | None = field(default=None, metadata={"help": "device of the DiT (default: --device)"})
    lora_merge: bool = field(default=False, metadata={
        "help": "merge the chosen LoRA into the weights (slightly faster steps, but a host copy of every weight it "
                "touches); default: an unmerged adapter branch, so switching costs only the LoRA's own size"})
    fp8_base: bool = field(default=False, metadata={
        "help": "store the DiT's block weights as float8 e4m3 with per-channel scales (about half the DiT "
                "memory of bf16)"})
    blocks_to_swap: int = field(default=0, metadata={
        "help": "keep the DiT's last N blocks in pinned CPU memory and stream each to the GPU just before it "
                "runs (~0.68 GB bf16 saved per block of the real DiT); 0 = off", "min": 0, "max": 1 << 10})
    threads: int = field(default=0, metadata=cli_help(
        "torch CPU threads for generation; 0 = auto: on the CPU half the cores (at most 4), on a GPU torch's "
        "default", min=0, max=1024))
    sam_model: str = field(default="auto", metadata={
        "help": "a local SAM checkpoint folder (e.g. a download of facebook/sam-vit-base) for the \"Select object\" "
                "button: click an object on the mask preview to add it to the mask; auto = a facebook/sam-vit-* "
                "checkpoint already in the Hugging Face cache, if any (nothing is downloaded); '' = no button"})
    preload: bool = field(default=True, metadata={
        "help": "start loading the model in the background at startup (--no-preload: load it on "
                "the first Generate)"})

    def __post_init__(self) -> None:
        from ..models.presets import get_preset  # pure data: fails fast on a typo, before any loading

        get_preset(self.model)
        if self.lightning_lora and not Path(self.lightning_lora).expanduser().is_file():
            raise ValueError(f"--lightning_lora {self.lightning_lora} is not a file; give the Lightning LoRA's "
                             ".safetensors path (or leave the flag out)")
        if not 0 < self.port < 65536:
            raise ValueError(f"--port {self.port} is not a TCP port; give 1..65535")
        if not self.max_upload_mb > 0:
            raise ValueError(f"--max_upload_mb {self.max_upload_mb} must be > 0")
        if not self.max_temp_mb > 0:
            raise ValueError(f"--max_temp_mb {self.max_temp_mb} must be > 0")
        if self.threads < 0:
            raise ValueError(f"--threads {self.threads} must be >= 0 (0 = auto)")
        if self.max_prompt_tokens < 1:
            raise ValueError(f"--max_prompt_tokens {self.max_prompt_tokens} must be >= 1")
        if self.sam_model not in ("", "auto", "none"):  # a wrong folder: one line at start, not at the first click
            from ..inference.segment import check_sam_dir

            check_sam_dir(self.sam_model)
        from ..models.load.devices import check_device_flags  # before anything loads, as qie edit does

        check_device_flags({f"--{name}": getattr(self, name)
                            for name in ("device", "text_encoder_device", "vae_device", "dit_device")})

    @property
    def resolved_temp_dir(self) -> Path:
        """The UI's own subfolder: startup and pruning never touch anything else."""
        return Path(self.temp_dir or tempfile.gettempdir()) / f"diffsynth-qie-ui-{self.port}"

    @property
    def resolved_outputs_dir(self) -> Path:
        return Path(self.outputs_dir).expanduser().absolute()

    @property
    def max_temp_bytes(self) -> int:
        return int(self.max_temp_mb * 1024 * 1024)

    @property
    def max_upload_bytes(self) -> int:
        return int(self.max_upload_mb * 1024 * 1024)

    @property
    def transport_cap_bytes(self) -> int:
        """Gradio's own per-file cap (``launch(max_file_size=...)``), far above ``max_upload_bytes``.

        Why not the limit itself: the image editor uploads its canvas as a PNG when
        Generate is pressed, and a file refused at that point leaves the editor hanging
        with no message (gradio 6.31). So the user-facing limit is enforced by the
        handlers, with a message, and this cap only stops abuse (a browser canvas
        cannot even produce a PNG this large).
        """
        return max(4 * self.max_upload_bytes, 512 * 1024 * 1024)

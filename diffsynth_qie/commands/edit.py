"""`qie edit`: edit one or several reference images with a prompt (flow matching or LBM).

Inputs (images, mask, LoRA files) are validated before the model loads, so a typo
fails in milliseconds with the offending path instead of after a minutes-long load.
``--lbm_steps N`` switches to LBM bridge sampling and also writes ``<out>_sub.png``
(the white-prior sub-stream).
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

from ..data.images import MAX_IMAGE_PIXELS
from ..models.preset_flags import preset_help, preset_list, preset_type
from ..models.presets import DEFAULT_MAX_PROMPT_TOKENS
from ..utils.cli_checks import INT64_MAX, checked

log = logging.getLogger(__name__)
# output flags: leftovers of killed runs in their directories are removed before a run (cli.main)
OUTPUTS = {"out": "file", "before_after": "file"}
INPUTS = ("image", "mask", "lora", "dataset_metadata", "model_dir")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    m = parser.add_argument_group("model")
    m.add_argument("--model", default="tiny", type=preset_type(), metavar="PRESET",
                   help=f"{preset_help()}; {preset_list(lambda p: p.is_tiny)} are built on first use when "
                        "--model_dir is not given")
    m.add_argument("--model_dir", default=None, help="local directory with the model repo's layout")
    m.add_argument("--lora", action="append", default=[], metavar="PATH",
                   help="LoRA file to apply to the DiT (repeatable)")
    m.add_argument("--lora_scale", action="append", type=checked(float, -100, 100), default=[], metavar="S",
                   help="scale per --lora, in the same order (default 1.0 each)")
    m.add_argument("--lora_merge", action="store_true",
                   help="merge the LoRAs into the weights (slightly faster steps, but a host copy of every "
                        "weight a LoRA touches; fp32 weights only: on bf16/fp16 the rounding loses much of the "
                        "LoRA's delta, so it is refused); default: an unmerged adapter branch costing only the LoRA's size")
    m.add_argument("--zero_cond_t", action=argparse.BooleanOptionalAction, default=None,
                   help=f"override the preset's zero_cond_t (on for {preset_list(lambda p: p.zero_cond_t)} only)")
    io = parser.add_argument_group("inputs / output")
    io.add_argument("--image", action="append", default=[], metavar="PATH",
                    help="reference image (repeatable; the first is the one edited)")
    io.add_argument("--prompt", default=None)
    io.add_argument("--dataset_metadata", default=None, metavar="FILE",
                    help="take --image/--prompt from a dataset row instead (with --row)")
    io.add_argument("--dataset_base", default=None, metavar="DIR", help="base directory of the row's paths")
    io.add_argument("--row", type=checked(int, 0), default=0, help="row index in --dataset_metadata")
    io.add_argument("--before_after", default=None, metavar="PNG",
                    help="with --lora: also render without the LoRA (same seed) and write "
                         "[reference | without LoRA | with LoRA] side by side")
    io.add_argument("--negative_prompt", default="")
    io.add_argument("--max_prompt_tokens", type=checked(int, 1, 1 << 20), default=DEFAULT_MAX_PROMPT_TOKENS,
                    help="refuse prompts longer than this many tokens (Qwen-Image was trained on up to 512)")
    io.add_argument("--mask", default=None, metavar="PATH", help="white = region that may change")
    io.add_argument("--out", required=True, metavar="PNG", help="output image (LBM also writes <out>_sub.png)")
    s = parser.add_argument_group("sampling")
    s.add_argument("--steps", type=checked(int, 1, 10000), default=None,
                   help="flow-matching steps (default 40; 2.1-turbo 8; with --scheduler lightning the LoRA's 4 or 8)")
    s.add_argument("--cfg", type=checked(float, 0, 100), default=None,
                   help="true CFG scale (1 = no negative pass; default 4, Qwen-Image-2.1 1; Lightning forces 1)")
    s.add_argument("--strength", type=checked(float, 0, 1), default=1.0, metavar="S",
                   help="edit strength in [0, 1]: the sampler starts at σ = S from the source noised to it "
                        "(SDEdit; LBM starts its bridge part-way); 0 = the source, 1 = the full edit")
    s.add_argument("--scheduler", default="auto", choices=("auto", "default", "lightning"),
                   help="flow-matching schedule: lightning = the few-step schedule the Lightning LoRAs were "
                        "distilled with (CFG 1); auto = the schedule a --lora declares (its metadata, else the table "
                        "of public lines in docs/SCHEDULES.md), else lightning when its name or metadata says so")
    s.add_argument("--kv_cache", default="on", choices=("on", "off"),
                   help="Qwen-Image-2.1: keep the prefix's (prompt and references) keys and values across steps "
                        "(on: about 0.5 MiB per prefix token per prompt, doubled with CFG; off: recomputed at every "
                        "step, slower; qie plan --task edit --kv_cache off shows the memory)")
    add_cache_arguments(s)
    s.add_argument("--seed", type=checked(int, 0, INT64_MAX), default=0)
    s.add_argument("--height", type=checked(int, 16, 1 << 16), default=None, help="output height (multiple of 16)")
    s.add_argument("--width", type=checked(int, 16, 1 << 16), default=None, help="output width (multiple of 16)")
    s.add_argument("--max_output_pixels", type=checked(int), default=MAX_IMAGE_PIXELS,
                   help="refuse a larger explicit --width x --height (the cap input images have too)")
    s.add_argument("--max_pixels", type=checked(int, 256, 1 << 32), default=1024 * 1024,
                   help="output pixel budget when --height/--width are not given")
    s.add_argument("--mask_blend", type=checked(float, 0, 1), default=1.0, help="mask blend strength 0..1 (1 = keep outside exactly)")
    s.add_argument("--mask_feather", type=checked(float, 0, 4096), default=0.0, help="feather radius in pixels (inside the mask)")
    s.add_argument("--lbm_steps", type=checked(int, 1, 4), default=None, help="LBM bridge sampling with N steps (1-4)")
    s.add_argument("--lbm_noise", type=checked(float, 0, 10), default=0.005, help="LBM bridge noise s")
    d = parser.add_argument_group("devices")
    d.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: cuda when available)")
    d.add_argument("--device_map", default=None, metavar="SPEC",
                   help="per-component devices, e.g. text_encoder=cuda:1,dit=cuda:0,vae=cuda:0")
    for name, what in (("text_encoder", "the text encoder"), ("vae", "the VAE"), ("dit", "the DiT")):
        d.add_argument(f"--{name}_device", default=None, metavar="DEVICE",
                       help=f"device of {what} (default: --device); the same as {name}=DEVICE in --device_map")
    d.add_argument("--cpu_offload", action="store_true",
                   help="keep components on the CPU, move each to the GPU only while it runs")
    d.add_argument("--blocks_to_swap", type=checked(int, 0, 1 << 10), default=0, metavar="N",
                   help="keep the DiT's last N blocks in pinned CPU memory and stream each to the GPU just before "
                        "it runs (~0.68 GB bf16 saved per block of the real DiT; docs/MEMORY.md); 0 = off")
    d.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU), bf16, fp16, fp32")
    d.add_argument("--fp8_base", action="store_true",
                   help="store the DiT's block weights as float8 e4m3 with per-channel scales (about half "
                        "the DiT memory of bf16; compute stays in --dtype)")
    d.add_argument("--fp8_compute", action="store_true",
                   help="multiply those FP8 weights in FP8 on the tensor cores (torch._scaled_mm, row-wise scales, "
                        "activations quantised per row; implies --fp8_base; LoRA branches stay bf16); needs a GPU "
                        "with FP8 (compute capability 8.9+: L40S, RTX 4090, H100, H200) and bf16")
    d.add_argument("--compile", action="store_true",
                   help="torch.compile each DiT block (regional; faster steps on a GPU after about a minute of compiling)")
    d.add_argument("--gpu_memory_gb", type=checked(float, 0.1, 1 << 20), default=None, metavar="GB",
                   help="the GPU memory the preflight judges the edit's peak against (default: the visible GPU's)")
    d.add_argument("--no_preflight", action="store_true",
                   help="skip the preflight: before a real preset loads, this very edit with these options runs "
                        "on a fake CUDA device (full width, 2 DiT blocks, no memory; seconds), and its peak, "
                        "scaled to the whole DiT, must fit --gpu_memory_gb")


def add_cache_arguments(group) -> None:
    """The step cache's flags (``qie edit``, ``qie eval-edits``, ``qie plan --task edit``)."""
    from ..models.samplers.step_cache import LEVEL_NAMES, METHODS

    group.add_argument("--cache", default="off", choices=LEVEL_NAMES,
                       help="step cache: reuse the DiT blocks' work of an earlier step at some steps "
                            "(docs/STEP_CACHE.md); off = every step exact (default); balanced = about half the DiT calls at 40 steps, "
                            "held-out edits within 0.3 dB; fast = about two thirds, within 1 dB; LBM: no effect")
    group.add_argument("--cache_method", default=None, choices=METHODS,
                       help="first_block (the levels' own): the first block's change decides each call (one boolean "
                            "read on the host per DiT call); schedule: the steps that reuse are fixed from a "
                            "calibrated curve before sampling (no host read)")
    group.add_argument("--cache_threshold", type=checked(float, 0, 100), default=None, metavar="T",
                       help="the method's threshold (default: the level's): first_block, the first block's relative "
                            "change; schedule, the accumulated magnitude error; higher reuses more, 0 nothing")


def lora_pairs(paths: list[str], scales: list[float]) -> list[tuple[str, float]]:
    """Pair --lora with --lora_scale by position; no scales means 1.0 each."""
    if scales and len(scales) != len(paths):
        raise ValueError(f"got {len(paths)} --lora but {len(scales)} --lora_scale; "
                         "give one --lora_scale per --lora, or none for 1.0")
    return [(p, scales[i] if scales else 1.0) for i, p in enumerate(paths)]


def resolve_row(args: argparse.Namespace) -> None:
    """Fill --image/--prompt from ``--dataset_metadata``'s row ``--row`` when they are not given."""
    if args.dataset_metadata is None:
        if not args.image or args.prompt is None:
            raise ValueError("give --image and --prompt (or --dataset_metadata FILE --row N)")
        return
    from ..data.formats import read_rows

    rows = read_rows(args.dataset_metadata, args.dataset_base)
    if not 0 <= args.row < len(rows):
        raise ValueError(f"--row {args.row} is out of range: {args.dataset_metadata} has {len(rows)} rows")
    row = rows[args.row]
    args.image = args.image or [str(p) for p in row.edit_images]
    args.prompt = args.prompt if args.prompt is not None else row.prompts[0]
    if not args.image:
        raise ValueError(f"row {args.row} of {args.dataset_metadata} has no source image; pass --image")


def check_reference_count(model: str, count: int) -> None:
    """At most the family's ``max_references`` reference images (DiffSynth fails later, or truncates)."""
    from ..models.presets import family_of

    family = family_of(model)
    if count > family.max_references:
        raise ValueError(f"{count} reference images (--image) for --model {model}: {family.label} takes at most "
                         f"{family.max_references}; pass {family.max_references} or fewer")


def load_inputs(args: argparse.Namespace):
    """Read and check every input file; raises FileNotFoundError/ValueError naming the path."""
    from ..data.images import aspect_differs, check_geometry, load_mask, load_rgb

    resolve_row(args)
    check_reference_count(args.model, len(args.image))
    if args.before_after and not args.lora:
        raise ValueError("--before_after compares with and without a LoRA: give --lora too")
    images = [load_rgb(p) for p in args.image]
    for path, im in zip(args.image, images):
        check_geometry(im.size, f"--image {path}")
    mask = load_mask(args.mask) if args.mask else None
    loras = lora_pairs(args.lora, args.lora_scale)
    for path, _ in loras:
        if not Path(path).is_file():
            raise FileNotFoundError(f"LoRA file not found: {path} (--lora takes a .safetensors file)")
    if args.out is None or Path(args.out).suffix.lower() not in (".png", ".jpg", ".jpeg", ".webp"):
        raise ValueError(f"--out {args.out} needs an image extension (.png, .jpg, .webp)")
    from ..utils.atomic import check_output_file

    for flag, path in (("--out", args.out), ("--before_after", args.before_after)):
        if path:
            check_output_file(path, flag)
    if mask is not None and aspect_differs(mask.size, images[0].size):
        log.warning("--mask %s is %dx%d but the image is %dx%d: the mask is stretched to the image's shape; check "
                    "that it belongs to this image", args.mask, *mask.size, *images[0].size)
    return images, mask, loras


def sub_path(out: str | Path) -> Path:
    """Where the LBM sub-stream image goes: ``O.png`` -> ``O_sub.png``."""
    out = Path(out)
    return out.with_name(f"{out.stem}_sub{out.suffix}")


def edit_load(args: argparse.Namespace, loras: list[tuple[str, float]]):
    """The load options of ``args`` as the preflight repeats them (each LoRA file, and its rank from its header)."""
    from ..inference.devices import parse_dtype
    from ..preflight.edit_step import EditLoad
    from ..preflight.edit_standins import lora_rank_of

    return EditLoad(fp8_base=args.fp8_base or args.fp8_compute, fp8_compute=args.fp8_compute,
                    blocks_to_swap=args.blocks_to_swap,
                    lora_ranks=tuple(lora_rank_of(p) for p, _ in loras), lora_scales=tuple(s for _, s in loras),
                    lora_paths=tuple(str(p) for p, _ in loras),
                    lora_merge=args.lora_merge, compile=args.compile, zero_cond_t=args.zero_cond_t,
                    dtype=parse_dtype(args.dtype), one_gpu=one_gpu(args))


def one_gpu(args: argparse.Namespace) -> bool:
    """Every component on the same GPU (what the preflight's memory verdict judges)."""
    from ..inference.devices import parse_device_map

    placed = {d if ":" in d else f"{d}:0" for d in (args.device, *parse_device_map(args.device_map).values(),
                                                  args.text_encoder_device, args.vae_device, args.dit_device) if d}
    return not args.cpu_offload and len(placed) <= 1 and not any(str(d).startswith("cpu") for d in placed)


def run(args: argparse.Namespace) -> int:
    images, mask, loras = load_inputs(args)  # before any heavy import or model load
    from ..lora.frozen import stack_hint
    from ..models.samplers.declared import plan_schedule
    from ..models.presets import family_of, get_preset

    preset, family = get_preset(args.model), family_of(args.model)
    stack_hint([p for p, _ in loras])
    plan = plan_schedule(args.scheduler, args.steps, args.cfg, [p for p, _ in loras], family.name,
                         default_steps=len(preset.sigmas) if preset.sigmas else family.default_steps,
                         default_cfg=family.default_cfg)
    args.scheduler, args.steps, args.cfg = plan.scheduler, plan.steps, plan.cfg

    from ..data.images import side_by_side
    from ..inference import EditRequest, Editor
    from ..inference.checks import check_request
    from ..inference.editor import device_map_with
    from ..models.load.devices import check_device_flags
    from ..utils.atomic import atomic_path

    request = EditRequest(
        images=images, prompt=args.prompt, negative_prompt=args.negative_prompt, mask=mask, steps=args.steps,
        cfg=args.cfg, seed=args.seed, height=args.height, width=args.width, max_pixels=args.max_pixels,
        max_output_pixels=args.max_output_pixels,
        mask_blend=args.mask_blend, mask_feather=args.mask_feather, lbm_steps=args.lbm_steps,
        lbm_noise=args.lbm_noise, max_prompt_tokens=args.max_prompt_tokens, scheduler=args.scheduler,
        strength=args.strength, sigmas=plan.sigmas, kv_cache=args.kv_cache == "on",
        cache=args.cache, cache_method=args.cache_method, cache_threshold=args.cache_threshold,
    )
    check_request(request)  # every value, before a model loads
    check_device_flags({f"--{name}": getattr(args, name.replace("-", "_"), None)
                        for name in ("device", "text_encoder_device", "vae_device", "dit_device")})

    if not preset.is_tiny and family.fullsize_verify and not args.no_preflight:
        from ..preflight.edit import preflight

        preflight(args.model, request, edit_load(args, loras), args.gpu_memory_gb)
    editor = Editor.from_preset(args.model, model_dir=args.model_dir, device=args.device, torch_dtype=args.dtype,
                                device_map=device_map_with(args.device_map, text_encoder=args.text_encoder_device,
                                                           vae=args.vae_device, dit=args.dit_device),
                                cpu_offload=args.cpu_offload,
                                zero_cond_t=args.zero_cond_t, lora_merge=args.lora_merge,
                                fp8_base=args.fp8_base, blocks_to_swap=args.blocks_to_swap,
                                fp8_compute=args.fp8_compute)
    if args.compile:
        from ..models.load.compile import compile_blocks

        compile_blocks(editor.pipe.dit)
    if loras:
        editor.set_loras(loras)
    result = editor.edit(request)
    log.info("edited %dx%d (%s) in %.2f s%s", result.width, result.height,
             f"LBM {args.lbm_steps} step(s)" if args.lbm_steps else f"{args.steps} steps, cfg {args.cfg:g}",
             result.seconds, "" if result.cache is None else
             f"; the step cache ({args.cache}) reused {result.cache.skipped} of {result.cache.calls} DiT calls")
    if args.compile:  # one graph per block code across prompt lengths, sizes and CFG; more means recompiles
        from ..models.load.compile import log_compile_counts

        log_compile_counts(editor.pipe.dit, "after the edit")
    outputs = [(Path(args.out), result.image)]
    if result.sub_image is not None:
        outputs.append((sub_path(args.out), result.sub_image))
    if args.before_after:
        editor.set_loras([])
        base = editor.edit(request)
        change = ((result.latents - base.latents).norm() / base.latents.norm()).item()
        log.info("the LoRA changes the output latents by %.3g (relative L2)", change)
        outputs.append((Path(args.before_after), side_by_side([images[0].resize(result.image.size), base.image, result.image])))
    from ..ui.results import cli_png_info

    out_png = Path(args.out) if Path(args.out).suffix.lower() == ".png" else None
    for path, image in outputs:
        with atomic_path(path) as tmp:  # the result PNG carries its settings, as the web UI's do (it reads them back)
            image.save(tmp, **({"pnginfo": cli_png_info(args, loras)} if path == out_png else {}))
        log.info("wrote %s (%dx%d)", path, *image.size)
    return 0


def interrupted(args: argparse.Namespace) -> str:
    return f"no output was written to {args.out} (images are written whole or not at all)"

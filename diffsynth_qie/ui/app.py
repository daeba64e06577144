"""The Gradio layout: widgets wired to :mod:`diffsynth_qie.ui.handlers`, nothing else.

Every decision (mask extraction, LoRA containment, limits, errors) lives in the
handler layer so it is unit-tested without a browser; this module only lays out
widgets, converts their values to :class:`GenerateInputs` and turns exceptions into
``gr.Error`` messages.
"""
from __future__ import annotations

import logging
from typing import Any

import gradio as gr

from .config import UIConfig
from .handlers import (LBM_MAX_STEPS, MODE_FLOW, MODE_LBM, MODE_LIGHTNING, NO_LORA, GenerateInputs, UIHandlers,
                       user_message)
from .uploads import check_upload, to_8bit_upload

log = logging.getLogger(__name__)

INTRO = """# Qwen-Image-Edit · mask edit
Upload an image, **paint the region that may change** (painted = edit region, like a white
pixel in `qie edit --mask`; nothing painted = the whole image may change), describe the edit,
press **Generate**."""


def _upload_paths(payload: Any) -> list[tuple[str, str]]:
    """(what, path) of each uploaded file in an ImageEditor payload (background, layers)."""
    out = []
    background = getattr(payload, "background", None)
    if getattr(background, "path", None):
        out.append(("image", background.path))
    for i, layer in enumerate(getattr(payload, "layers", None) or []):
        if getattr(layer, "path", None):
            out.append((f"mask layer {i + 1}", layer.path))
    return out


def guard_uploads(component: gr.components.Component, handlers: UIHandlers) -> None:
    """Check ``component``'s uploads before gradio decodes them, and show our message on failure.

    Gradio decodes an ImageEditor's files in its own ``preprocess``, before any handler
    runs: a non-image or a 12000x12000 PNG would fail (or fill memory) there and show a
    bare "Error", and PIL's conversion there would clip a 16-bit PNG to white. The files
    are checked first (bytes, image header, pixel count), 16-bit ones rewritten as 8-bit
    by the project's loader, and any failure becomes a ``gr.Error`` with our message.
    """
    original = component.preprocess
    limit = handlers.config.max_upload_bytes

    def preprocess(payload: Any) -> Any:
        try:
            for what, path in _upload_paths(payload):
                check_upload(path, limit, what)
                to_8bit_upload(path)
            return original(payload)
        except Exception as exc:  # noqa: BLE001 - every failure gets a message, never a bare "Error"
            raise gr.Error(user_message(exc), duration=None, print_exception=False) from None

    component.preprocess = preprocess


def build_ui(handlers: UIHandlers) -> gr.Blocks:
    """The whole UI; queued so that one generation runs at a time."""
    with gr.Blocks(title="Qwen-Image-Edit mask edit", analytics_enabled=False) as demo:
        gr.Markdown(INTRO)
        model_status = gr.Markdown(handlers.model_status(), elem_id="model-status")
        status_timer = gr.Timer(2.0, active=handlers.loading)  # follows a background model load
        with gr.Row():
            with gr.Column(scale=3):
                editor = gr.ImageEditor(
                    label="Image and mask (paint the region to edit)", type="filepath", image_mode="RGBA",
                    sources=["upload", "clipboard"], transforms=(), layers=False, format="png",
                    brush=gr.Brush(colors=["rgba(255, 0, 255, 0.6)"], color_mode="fixed"),
                    elem_id="editor")
                references = gr.Gallery(label="Extra reference images (optional)", type="filepath",
                                        interactive=True, columns=4, height=160, file_types=["image"],
                                        elem_id="references")
                guard_uploads(editor, handlers)
                guard_uploads(references, handlers)
                prompt = gr.Textbox(label="Prompt", lines=2, placeholder="what should change", elem_id="prompt")
                negative = gr.Textbox(label="Negative prompt", lines=1, elem_id="negative-prompt")
            with gr.Column(scale=2):
                mode = gr.Radio([("Flow matching", MODE_FLOW), (f"LBM (1–{LBM_MAX_STEPS} steps)", MODE_LBM),
                                 ("Lightning (4 / 8 steps)", MODE_LIGHTNING)],
                                value=MODE_FLOW, label="Sampler", elem_id="mode")
                steps = gr.Slider(1, 100, value=40, step=1, label="Steps", elem_id="steps")
                lbm_steps = gr.Slider(1, LBM_MAX_STEPS, value=1, step=1, label="LBM steps", visible=False,
                                      elem_id="lbm-steps")
                cfg = gr.Slider(1.0, 10.0, value=4.0, step=0.5, label="CFG", elem_id="cfg")
                seed = gr.Number(value=0, precision=0, label="Seed (-1 = random)", elem_id="seed")
                mask_blend = gr.Slider(0.0, 1.0, value=1.0, step=0.05, label="Mask blend strength",
                                       elem_id="mask-blend")
                with gr.Row(equal_height=True):
                    lora = gr.Dropdown(handlers.lora_choices(), value=NO_LORA, label="LoRA", scale=5,
                                       elem_id="lora")
                    refresh = gr.Button("Refresh", scale=1, min_width=80, elem_id="lora-refresh")
                with gr.Row(equal_height=True):
                    lora_scale = gr.Slider(-2.0, 2.0, value=1.0, step=0.05, label="LoRA scale", elem_id="lora-scale")
                    strength = gr.Slider(0.0, 1.0, value=1.0, step=0.05, label="Edit strength (0 = source, 1 = full)",
                                         elem_id="strength")
                lora_status = gr.Markdown(handlers.lora_status(), elem_id="lora-status")
                generate = gr.Button("Generate", variant="primary", elem_id="generate")
        status = gr.Markdown("", elem_id="status")
        with gr.Row():
            output = gr.Image(label="Output", type="pil", format="png", interactive=False, height=360,
                              buttons=["download", "fullscreen"], elem_id="output")
            sub_output = gr.Image(label="LBM sub-stream output", type="pil", format="png", interactive=False,
                                  height=360, buttons=["download", "fullscreen"], visible=False,
                                  elem_id="output-sub")

        def refresh_loras(current: str | None):
            choices = handlers.lora_choices()
            return (gr.update(choices=choices, value=current if current in choices else NO_LORA),
                    handlers.lora_status())

        def poll_model_status():
            return handlers.model_status(), gr.Timer(active=handlers.loading)

        def switch_mode(selected: str):
            lbm = selected == MODE_LBM  # LBM samples without CFG: its steps replace steps and CFG
            few = selected == MODE_LIGHTNING  # Lightning: 4 or 8 steps at CFG 1
            return (gr.update(visible=not lbm, **({"value": 8} if few else {})),
                    gr.update(visible=not (lbm or few)), gr.update(visible=lbm), gr.update(visible=lbm))

        def run(editor_value: Any, refs: Any, prompt_text: str, negative_text: str, mode_value: str,
                steps_value: float, lbm_value: float, cfg_value: float, seed_value: float, blend: float,
                lora_name: str, scale: float, strength_value: float, progress=gr.Progress()):
            inputs = GenerateInputs(
                editor=editor_value, references=refs, prompt=prompt_text, negative_prompt=negative_text,
                mode=mode_value, steps=steps_value, lbm_steps=lbm_value, cfg=cfg_value, seed=seed_value,
                mask_blend=blend, lora=lora_name, lora_scale=scale, strength=strength_value)
            try:
                out = handlers.generate(inputs, lambda done, total, desc: progress((done, total), desc=desc))
            except Exception as exc:  # user_message logs tracebacks of unexpected errors
                raise gr.Error(user_message(exc), duration=None, print_exception=False) from None
            return out.image, out.sub_image, out.status, handlers.model_status()

        refresh.click(refresh_loras, lora, [lora, lora_status], queue=False)
        demo.load(refresh_loras, lora, [lora, lora_status], queue=False)
        demo.load(handlers.model_status, None, model_status, queue=False)
        status_timer.tick(poll_model_status, None, [model_status, status_timer], queue=False)
        mode.change(switch_mode, mode, [steps, cfg, lbm_steps, sub_output], queue=False)
        generate.click(run, [editor, references, prompt, negative, mode, steps, lbm_steps, cfg, seed,
                             mask_blend, lora, lora_scale, strength],
                       [output, sub_output, status, model_status], concurrency_limit=1)
    demo.queue(default_concurrency_limit=1)
    return demo


def launch(demo: gr.Blocks, config: UIConfig, **kwargs: Any):
    """Serve ``demo`` per ``config`` (127.0.0.1 unless told otherwise; share is opt-in)."""
    if config.share:
        log.warning("--share: the UI gets a public gradio.live URL; anyone with it can run generations")
    return demo.launch(server_name=config.host, server_port=config.port, share=config.share,
                       max_file_size=config.transport_cap_bytes, show_error=False, ssr_mode=False,
                       footer_links=[], **kwargs)

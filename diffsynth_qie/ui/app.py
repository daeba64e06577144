"""The Gradio layout: widgets wired to :mod:`diffsynth_qie.ui.handlers`, nothing else.

Every decision (mask extraction, LoRA containment, limits, errors) lives in the
handler layer so it is unit-tested without a browser; this module lays out widgets
and wires their events (``ui/events.py`` holds the callbacks).
"""
from __future__ import annotations

import logging
from typing import Any

import gradio as gr

from .config import UIConfig
from .events import Callbacks, brush
from .handlers import MODE_FLOW, UIHandlers, user_message
from .examples import examples_label
from .mask_events import EMPTY, MaskTools
from .messages import toast_html
from .masks import DEFAULT_BRUSH, MAX_BRUSH
from .model_fit import default_cfg, family_label
from .page import CSS, JS
from .select_object import ObjectSelect
from .settings import RESTORED, build_widget
from .uploads import check_upload, to_8bit_upload

log = logging.getLogger(__name__)

def intro(family: str) -> str:
    """The page's heading, naming the served model family."""
    return f"""# {family} · mask edit
Upload an image (or click an example), **paint the region that may change** (nothing painted: the whole image may
change; Ctrl+Z / Ctrl+Y undo and redo, the preview beside the mask file shows the mask Generate will use), describe
the edit, press **Generate** (or Ctrl+Enter). Every result is kept on disk and in the history below: click one to
get all its settings back, or drop a result PNG on "Settings from a PNG"."""

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
            raise gr.Error(toast_html(user_message(exc)), duration=None, print_exception=False) from None

    component.preprocess = preprocess


def build_ui(handlers: UIHandlers) -> gr.Blocks:
    """The whole UI; queued so that one generation runs at a time."""
    cb, tools = Callbacks(handlers), MaskTools(handlers)
    select = ObjectSelect.from_config(tools)
    widgets: dict[str, gr.components.Component] = {}  # setting name -> its widget

    def add(name: str, **extra: Any) -> gr.components.Component:
        """Setting ``name``'s widget (declared in ``ui/settings.py``), placed here in the layout."""
        widgets[name] = build_widget(name, **extra)
        return widgets[name]

    # The prompt sits in the right column, the examples (left column) fill it: made here, placed there.
    prompt_box = widgets["prompt"] = build_widget("prompt", render=False)

    family = family_label(handlers.config.model)
    with handlers.one_look():  # the LoRA folder as the page opens: each header read once
        lora_options, picked = handlers.lora_options(), handlers.default_lora()
        lora_text, modes = handlers.lora_status(picked), handlers.mode_choices()
    with gr.Blocks(title=f"{family} mask edit", analytics_enabled=False) as demo:
        gr.Markdown(intro(family))
        model_status = gr.Markdown(handlers.model_status(), elem_id="model-status")
        status_timer = gr.Timer(2.0, active=handlers.loading)  # follows a background model load
        history = gr.State([])          # this tab's results, newest first
        current = gr.State(None)        # the history entry shown in the slider
        prev_mode = gr.State(MODE_FLOW)
        saved_steps = gr.State(40)      # the flow-matching steps, kept while Lightning sets 8
        queued_at = gr.State(None)
        batch = gr.State([])            # the entries of the last Generate (its variations)
        with gr.Row():
            with gr.Column(scale=3):
                editor = add("editor", brush=brush(DEFAULT_BRUSH))
                gr.HTML("<div id='drop-message' role='alert'></div>")
                with gr.Row(equal_height=True):
                    clear_mask = gr.Button("Clear paint", size="sm", min_width=90, scale=0, elem_id="mask-clear")
                    brush_size = gr.Slider(1, MAX_BRUSH, value=DEFAULT_BRUSH, step=1, elem_id="brush-size",
                                           label="Brush size (px; keys [ and ])")
                    add("mask_invert")
                with gr.Row(equal_height=True):
                    add("mask_grow")
                    add("mask_feather")
                with gr.Row(equal_height=True):
                    references = add("references")
                    mask_file = add("mask_file")
                    preview = gr.Image(label="Mask Generate uses (drag: box)", type="pil",
                                       interactive=False, height=160, scale=1, elem_id="mask-preview", format="png",
                                       buttons=["fullscreen"])
                preview_text = gr.Markdown(EMPTY, elem_id="mask-preview-text")
                select.button()  # armed by page.JS, which then writes the clicked pixel into select_point
                select_point = gr.Textbox(elem_id="select-point", elem_classes=["page-input"], container=False)
                box_drag = gr.Textbox(elem_id="box-drag", elem_classes=["page-input"], container=False)  # page.JS
                guard_uploads(editor, handlers)
                guard_uploads(references, handlers)
                loaded = add("loaded_image")  # what the UI last put into the editor (Callbacks.lock_generate)
                examples, rows = cb.examples(), None
                if examples:
                    rows = gr.Examples([[ex.editor_value(), list(ex.references) or None, ex.mask, ex.prompt]
                                        for ex in examples],
                                       [editor, references, mask_file, prompt_box], elem_id="examples",
                                       examples_per_page=4,
                                       label=examples_label(handlers.config.model))
                settings_png = gr.File(label="Settings from a PNG (drop a result of this UI)", file_types=[".png"],
                                       type="filepath", height=90, elem_id="settings-png")
            with gr.Column(scale=2):
                prompt_box.render()
                with gr.Row(elem_id="actions"):
                    generate = gr.Button("Generate (Ctrl+Enter)", variant="primary", elem_id="generate")
                    stop = gr.Button("Stop", variant="stop", elem_id="stop")  # always clickable: harmless when idle
                status = gr.Markdown("", elem_id="status")
                result = gr.ImageSlider(label="Before / after (drag the handle)", type="filepath", interactive=False,
                                        height=360, buttons=["fullscreen"], elem_id="result")
                sub_output = gr.Image(label="LBM white-prior stream (second output)", type="filepath",
                                      interactive=False, height=360, buttons=["download", "fullscreen"], visible=False,
                                      elem_id="output-sub")
                variants = gr.Gallery(label="Variations (click one to show it above)", columns=8, height=110,
                                      fit_columns=False, object_fit="contain", allow_preview=False, visible=False,
                                      elem_id="variations-grid")
                edit_this = gr.Button("Edit this result", interactive=False, elem_id="edit-result")
                # its own row, full width: beside the button the names were cut to ".p"
                downloads = gr.File(label="Download (PNG with its settings; input; mask)",
                                    file_count="multiple", interactive=False, elem_id="downloads")
                command = gr.Textbox(label="Copy as a qie edit command", buttons=["copy"], interactive=False,
                                     lines=2, elem_id="qie-command")
                mode = add("mode", choices=modes)
                steps = add("steps")
                lbm_steps = add("lbm_steps")
                cfg = add("cfg", value=default_cfg(handlers.config.model))
                add("cache")
                with gr.Row(equal_height=True):
                    add("seed")
                    add("variations")
                with gr.Row(equal_height=True):
                    lora = add("lora", choices=lora_options, value=picked)
                    refresh = gr.Button("Refresh", scale=1, min_width=80, elem_id="lora-refresh")
                add("lora_scale")
                lora_status = gr.Markdown(lora_text, elem_id="lora-status")
                stack = gr.Button(visible=False, size="sm", elem_id="lora-stack")  # LoraEvents.stack_button
                with gr.Accordion("Advanced", open=False, elem_id="advanced") as advanced:
                    negative = add("negative_prompt")
                    add("strength")
                    add("mask_blend")
                    lora2 = add("lora2", choices=lora_options)
                    add("lora2_scale")
                    add("live_preview")
                    with gr.Row(equal_height=True):
                        add("width")
                        add("height")
                        input_size = gr.Button("Keep the input's size", size="sm", elem_id="input-size")
        gallery = gr.Gallery(label="History (kept on disk; click to restore everything)", columns=8, height=170,
                             fit_columns=False, object_fit="contain", allow_preview=False, elem_id="history")

        mode_outputs = [steps, cfg, lbm_steps, sub_output, prev_mode, saved_steps, negative]
        shown = [result, sub_output, downloads, command, edit_this, current]
        # Generate's inputs: every setting's widget, given to the callbacks as one dict (named by Callbacks.bind).
        gen_inputs = cb.bind(widgets)
        run_inputs = cb.bind(widgets, history=history, queued_at=queued_at, current=current)

        lora_outputs = [lora, lora2, lora_status, mode, stack]
        demo.load(cb.refresh_loras, [lora, lora2], lora_outputs, queue=False)
        demo.load(handlers.model_status, None, model_status, queue=False)
        demo.load(cb.saved_history, None, [history, gallery], queue=False)
        demo.unload(cb.disconnect)
        refresh.click(cb.refresh_loras, [lora, lora2], lora_outputs, queue=False)
        status_timer.tick(cb.poll_model_status, None, [model_status, status_timer], queue=False)
        mode.input(cb.switch_mode, [mode, prev_mode, steps, saved_steps], mode_outputs, queue=False)
        lora.input(cb.pick_lora, [lora, lora2, mode, prev_mode, steps, saved_steps],
                   [mode, lora_status, *mode_outputs, stack], queue=False)
        lora2.input(cb.pick_second, [lora, lora2, mode], [lora_status, stack, steps, cfg], queue=False)
        stack.click(cb.stack_frozen, [lora, lora2, mode],
                    [lora2, widgets["lora2_scale"], lora_status, stack, steps, cfg, advanced], queue=False)
        editor.upload(cb.new_image, editor, [editor, brush_size], queue=False, show_progress="hidden")
        brush_size.change(cb.set_brush, brush_size, editor, queue=False, show_progress="hidden")
        # The mask preview follows the paint, the mask file and the mask tools; a click on it is the box tool.
        mask_inputs = [editor, loaded, mask_file, widgets["mask_invert"], widgets["mask_grow"], widgets["mask_feather"]]
        for source in (editor, loaded, *mask_inputs[2:]):
            source.change(tools.preview, mask_inputs, [preview, preview_text], queue=False, show_progress="hidden",
                          trigger_mode="always_last")
        input_size.click(tools.input_size, [editor, loaded], [widgets["width"], widgets["height"], status],
                         queue=False)
        box_drag.change(tools.box, [box_drag, editor, loaded, mask_file], [mask_file, preview_text], queue=False)
        select_point.change(select.select, [select_point, editor, loaded, mask_file], [mask_file, preview_text],
                            queue=False)  # as the box tool: at once, beside a running generation

        # An image given to the editor: Generate waits for the record of it (see Callbacks.lock_generate).
        lock = dict(fn=cb.lock_generate, inputs=None, outputs=generate, queue=False, show_progress="hidden")
        if rows is not None:
            rows.dataset.click(**lock).then(cb.example_loaded, [rows.dataset, editor],
                                            [loaded, generate, status, editor, brush_size], queue=False,
                                            show_progress="hidden")
        clear_mask.click(**lock).then(cb.clear_mask, editor, [editor, loaded, generate, status], queue=False)
        edit_this.click(**lock).then(cb.edit_result, [current, editor], [editor, loaded, generate, status, mask_file, brush_size],
                                     queue=False)

        # Checked in the queue (so a refusal shows its toast) but outside the one-at-a-time limit, so it answers at
        # once even while another generation runs.
        checked = generate.click(cb.precheck, gen_inputs, [generate, queued_at, status], concurrency_limit=None,
                                 show_progress="hidden")
        running = checked.success(
            cb.run, run_inputs,
            [*shown, status, model_status, variants, history, gallery, batch], show_progress_on=[result],
            concurrency_limit=1)
        running.then(cb.finished, None, [generate, model_status], queue=False)
        # Stop is cooperative, not gradio's `cancels`: the run itself ends (at its start when still queued, else at its
        # next step) and reports where it stopped, so one path sets the status and `finished` always runs after it.
        stop.click(cb.stop, None, status, queue=False)
        restored = [widgets[name] for name in RESTORED]
        whole = [*restored, editor, loaded, mask_file, references, widgets["variations"], variants, batch, prev_mode,
                 saved_steps, brush_size, *shown, status]
        gallery.select(cb.restore, [history, editor], whole, queue=False)
        settings_png.upload(cb.load_png, [settings_png, editor, history], whole, queue=False)
        variants.select(cb.show_variation, [batch], shown, queue=False)
    demo.queue(default_concurrency_limit=1)
    return demo


def launch(demo: gr.Blocks, config: UIConfig, **kwargs: Any):
    """Serve ``demo`` per ``config`` (127.0.0.1 unless told otherwise; share is opt-in)."""
    if config.share:
        log.warning("--share: the UI gets a public gradio.live URL; anyone with it can run generations")
    return demo.launch(server_name=config.host, server_port=config.port, share=config.share,
                       max_file_size=config.transport_cap_bytes, show_error=False, ssr_mode=False,
                       footer_links=[], css=CSS, js=JS, allowed_paths=[str(config.resolved_outputs_dir)], **kwargs)

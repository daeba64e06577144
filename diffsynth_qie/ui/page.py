"""The page's own CSS and JavaScript: what runs in the browser without a round trip.

- Files dropped on, or picked with the upload button of, the editor or the reference gallery are checked first:
  a non-image, or an image the browser cannot decode, gets a message under the editor (gradio would ignore it
  without a word), and a later good image clears that message.
- Keys, as in other editors: Ctrl+Enter runs Generate; outside a text field, Ctrl+Z / Ctrl+Y (or Ctrl+Shift+Z)
  undo and redo the paint, and ``[`` / ``]`` make the brush smaller or larger.
- "Select object" (``ui/select_object.py``): its button arms it, and the next press on the mask preview sends that
  pixel to the server, which adds the object there to the mask file.
- While the editor loads an image the UI gave it, Generate and the canvas take no clicks (a stroke made then
  would be dropped, and Generate would edit the whole image).
- Layout: results fill their box; download names wrap rather than shrink to their extension; a toast's list is a
  list; on a phone, Generate and Stop stay at the bottom of the screen and the
  examples table fits the screen's width.
"""
from __future__ import annotations

CSS = """
#result img, #output-sub img { object-fit: contain; width: 100%; height: 100%; }
#drop-message:empty { display: none; }
#drop-message { color: var(--error-text-color); font-weight: 600; }
#lora input { padding-right: 2.2em; text-overflow: ellipsis; }
#examples table { table-layout: fixed; width: 100%; }
#examples td { white-space: normal; overflow-wrap: anywhere; }
#examples td img { max-width: 100%; height: auto; }
#mask-preview-text p { margin: 0; }
.page-input { display: none !important; }
#mask-preview img { cursor: crosshair; touch-action: none; }
body[data-select-armed] #select-object { outline: 3px solid var(--color-accent); }
.editor-busy { pointer-events: none !important; opacity: 0.5; }
#downloads .filename { overflow: visible; min-width: 0; }
#downloads .filename .stem { white-space: normal; overflow-wrap: anywhere; }
[data-testid=toast-text] ul { margin: 0.3em 0 0.3em 1.2em; padding: 0; list-style: disc; }
@media (max-width: 640px) {
  #actions { position: fixed; left: 0; right: 0; bottom: 0; z-index: 1000; padding: 6px 8px; margin: 0;
             background: var(--background-fill-primary); box-shadow: 0 -2px 8px rgba(0, 0, 0, 0.25); }
  .gradio-container { padding-bottom: 64px; }
  #editor > label[data-testid=block-label] { display: none; }  /* under the toolbar at this width */
  #examples td:first-child, #examples th:first-child { width: 28%; }
}
"""

JS = """
() => {
  const note = () => document.querySelector('#drop-message');
  const say = (text) => { const n = note(); if (n) n.textContent = text; };
  const inTarget = (node) => node instanceof Element && node.closest('#editor, #references');
  const notImage = (f) => !(f.type || '').startsWith('image/');
  // An image the browser cannot decode (a corrupt .png) gets a message, a good one clears an old message.
  const decode = (files) => Promise.all(files.map((f) => createImageBitmap(f).then(() => null, () => f)))
    .then((bad) => { const b = bad.find((x) => x); say(b ? `${b.name} is not a readable image: it may be `
      + 'damaged; pick a PNG, JPEG or WebP file.' : ''); });
  document.addEventListener('drop', (event) => {
    if (!inTarget(event.target)) return;
    const files = Array.from((event.dataTransfer && event.dataTransfer.files) || []);
    const bad = files.find(notImage);
    if (!bad) { decode(files); return; }
    event.preventDefault();
    event.stopPropagation();
    say(`${bad.name} is not an image: drop a PNG, JPEG or WebP file.`);
  }, true);
  document.addEventListener('change', (event) => {  // the upload buttons
    const input = event.target;
    if (!(input instanceof HTMLInputElement) || input.type !== 'file' || !inTarget(input)) return;
    const files = Array.from(input.files || []);
    const bad = files.find(notImage);
    if (!bad) { decode(files); return; }
    event.stopImmediatePropagation();  // gradio would load nothing and say nothing
    input.value = '';
    say(`${bad.name} is not an image: pick a PNG, JPEG or WebP file.`);
  }, true);
  const typing = (el) => el instanceof Element && (el.matches('textarea, input:not([type=range])')
                                                   || el.isContentEditable);
  const press = (selector) => { const b = document.querySelector(selector); if (b && !b.disabled) b.click(); };
  const brush = (delta) => {  // the brush-size slider, as if dragged (its change sets the editor's brush)
    const range = document.querySelector('#brush-size input[type=range]');
    if (!range) return;
    const value = Math.min(+range.max, Math.max(+range.min, +range.value + delta * Math.max(1,
      Math.round(+range.value * 0.2))));
    range.value = String(value);
    range.dispatchEvent(new Event('input', {bubbles: true}));
    range.dispatchEvent(new Event('change', {bubbles: true}));
  };
  // The box tool: a box dragged on the mask preview, in the image's pixels, goes to the hidden #box-drag box.
  let boxStart = null;
  const pixel = (event, img) => {
    const r = img.getBoundingClientRect(), w = img.naturalWidth, h = img.naturalHeight;
    const scale = Math.min(r.width / w, r.height / h);
    const x = (event.clientX - r.left - (r.width - w * scale) / 2) / scale;
    const y = (event.clientY - r.top - (r.height - h * scale) / 2) / scale;
    return [Math.round(Math.min(Math.max(x, 0), w - 1)), Math.round(Math.min(Math.max(y, 0), h - 1))];
  };
  document.addEventListener('pointerdown', (event) => {
    const img = event.target instanceof Element && event.target.closest('#mask-preview img');
    if (!img || !img.naturalWidth) return;
    event.preventDefault();
    boxStart = [img, pixel(event, img)];
  }, true);
  document.addEventListener('pointerup', (event) => {
    if (!boxStart) return;
    const [img, start] = boxStart;
    boxStart = null;
    const end = pixel(event, img);
    const box = document.querySelector('#box-drag textarea, #box-drag input');
    if (!box || (start[0] === end[0] && start[1] === end[1]) || document.body.dataset.selectArmed) return;
    box.value = [...start, ...end, Date.now()].join(',');
    box.dispatchEvent(new Event('input', {bubbles: true}));
  }, true);
  // "Select object" (shown only with a SAM checkpoint): the button arms (body[data-select-armed]: the page's own
  // state, which gradio's re-renders leave alone); the next press on the mask preview sends its pixel to the hidden
  // #select-point box (a box is not drawn then) and disarms.
  let selectAt = null;
  const arm = (on) => {
    if (on) document.body.dataset.selectArmed = '1'; else delete document.body.dataset.selectArmed;
  };
  document.addEventListener('click', (event) => {
    if (event.target instanceof Element && event.target.closest('#select-object'))
      arm(!document.body.dataset.selectArmed);
  }, true);
  document.addEventListener('pointerdown', (event) => {
    const img = event.target instanceof Element && event.target.closest('#mask-preview img');
    selectAt = img && img.naturalWidth ? pixel(event, img) : null;
  }, true);
  document.addEventListener('pointerup', () => {
    const at = selectAt;
    selectAt = null;
    const point = document.querySelector('#select-point textarea, #select-point input');
    if (!document.body.dataset.selectArmed || !at || !point) return;
    arm(false);
    point.value = [...at, Date.now()].join(',');
    point.dispatchEvent(new Event('input', {bubbles: true}));
  }, true);
  // While the editor is given an image (its progress overlay shows), a stroke would be dropped and Generate would
  // edit the whole image: Generate and the canvas take no clicks until it is in.
  setInterval(() => {
    const busy = !!document.querySelector('#editor > [data-testid=status-tracker]:not(.hide)');
    document.querySelectorAll('#generate, #editor canvas').forEach((e) => e.classList.toggle('editor-busy', busy));
  }, 150);
  document.addEventListener('keydown', (event) => {
    const ctrl = event.ctrlKey || event.metaKey;
    let done = true;
    if (event.key === 'Enter' && ctrl) press('#generate');  // Ctrl+Enter (Cmd+Enter) runs Generate
    else if (typing(event.target)) done = false;
    else if (ctrl && !event.shiftKey && event.key.toLowerCase() === 'z') press('#editor button[aria-label=Undo]');
    else if (ctrl && (event.key.toLowerCase() === 'y' || (event.shiftKey && event.key.toLowerCase() === 'z')))
      press('#editor button[aria-label=Redo]');
    else if (!ctrl && event.key === '[') brush(-1);
    else if (!ctrl && event.key === ']') brush(1);
    else done = false;
    if (done) { event.preventDefault(); event.stopPropagation(); }
  }, true);
}
"""

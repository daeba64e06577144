"""Qwen-Image-2.1's DiT on the fake CUDA device: its token-mask bookkeeping done on the host.

DiffSynth's ``QwenImage21DiT.forward`` (``diffsynth/models/qwen_image_21_dit.py``) and its ``QwenImage21Rope``
derive every position of the joint sequence from the reference-slot mask ``img_mask`` on the mask's device:
``repeat_interleave`` by the mask and a boolean ``index_put`` (lines 553-565), ``tolist`` and boolean
``index_put`` in the RoPE (lines 436-458), ``nonzero`` in ``build_token_metadata`` (513), ``nonzero`` for the
key mask (595) and ``int((~target_token_mask).sum())`` (599). On a GPU each is a host read of a device
tensor; on the fake device there is no value to read, so the run stops there. The mask itself is known on
the host: it comes from the cache (training) or the prompt encoder (editing), and our code moves it to the
device (``models/qwen_image_21/qwen21.py forward21``, ``models/family_ops.py Qwen21Ops.conditioning``), as does DiffSynth's
``model_fn_qwen_image_21`` (the target's slots, line 425).

:func:`host_bookkeeping21` makes the run possible, and changes nothing the device sees but the indexing:

- :class:`HostShadows` keeps the host values of the small integer and boolean device tensors that are made
  from host values only (a host mask moved to the device, ``torch.ones`` of the target's slots, their
  concatenation and views); nothing on the device is read.
- :func:`dit21_forward` replaces ``QwenImage21DiT.forward`` while the context is active. It is DiffSynth's
  forward (lines 549-659) with the mask's bookkeeping on the host: the joint sequence is one
  ``index_select`` of host-made row indices in place of ``repeat_interleave`` by the mask and the boolean
  ``index_put`` (553-565); the RoPE rows come from :func:`rope_rows` (567); ``build_token_metadata`` and
  ``_qwenimage21_prefix_segments`` (DiffSynth's own) run on the host mask; the key mask (591-597) is an
  ``index_put`` by integer indices; the target-token mask goes to the device once for the modulation rows
  (573). The rest is DiffSynth's: the blocks, the attention segments and the KV cache are called as the
  original calls them, and the lines between (570-589, 598-659: the checks, the decode and segment set-up,
  the block loop) are copied as they are.
- :func:`rope_rows` runs DiffSynth's own ``QwenImage21Rope.forward`` on the host over identity tables, so
  its position lists (lines 432-458) give each token's row of each axis table; the device gathers the rows.

A :class:`~.fake_device.FakeRunError` raised while these run names our caller's line, as it would without
them (:func:`reattributed`), and, inside the DiT's forward, the stand-in's line after it.

``tests/test_verify21_standin.py`` checks that the stand-in's output and gradients equal DiffSynth's forward
on a tiny 2.1 DiT (with and without references, with a key mask, with the prefix KV cache), so a DiffSynth
upgrade that changes the mirrored lines fails there; ``tests/test_verify21_fake.py`` runs it at full size.
Mirrored DiffSynth lines are those of ``diffsynth/models/qwen_image_21_dit.py`` as pinned.
"""
from __future__ import annotations

import contextlib
import functools
import os
import re
import traceback
import weakref
from types import SimpleNamespace
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_map

from .checks import op_leaves
from .ops import FAKE_DEVICE_FILES, CheckingMode, FakeRunError, our_frame

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHADOW_MAX_NUMEL = 1 << 16  # masks and index lists; never activations
_BOOKKEEPING_DTYPES = (torch.bool, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


class HostShadows(CheckingMode):  # (--compile compiles under it)
    """Enter inside :class:`~.fake_device.FakeCuda`. Every small bool/integer device tensor an operator makes
    from host tensors and shadowed device tensors only gets its values computed on the host too (seeded
    random operators excepted); an operator that writes into a shadowed storage drops its shadows."""

    def __init__(self):
        super().__init__()
        self._values: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}

    def values(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        """The host values of ``t``: itself when it is a real tensor, its shadow when it has one, else None."""
        if not isinstance(t, FakeTensor):
            return t
        entry = self._values.get(id(t))
        return entry[2] if entry is not None and entry[0]() is t else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            out = func(*args, **kwargs)
        except FakeRunError as e:
            raise FakeRunError(reattributed(str(e))) from None
        if func._schema.is_mutable:
            self._forget_written(func, args, kwargs)
            return out
        outs = op_leaves(out)
        if not outs or not all(_is_bookkeeping(o) for o in outs) or torch.Tag.nondeterministic_seeded in func.tags:
            return out
        inputs = [a for a in op_leaves(args, kwargs) if isinstance(a, torch.Tensor)]
        if any(self.values(a) is None for a in inputs):
            return out
        host_args, host_kwargs = tree_map(lambda a: self.values(a) if isinstance(a, torch.Tensor) else a,
                                          (args, kwargs))
        if "device" in host_kwargs:
            host_kwargs["device"] = torch.device("cpu")
        try:
            host_outs = op_leaves(func(*host_args, **host_kwargs))
        except (RuntimeError, TypeError, ValueError):
            return out
        for o, h in zip(outs, host_outs):
            key = id(o)
            self._values[key] = (weakref.ref(o, lambda _, k=key: self._values.pop(k, None)),
                                 _storage_key(o), h)
        return out

    def _forget_written(self, func, args, kwargs) -> None:
        written = [a for schema, a in zip(func._schema.arguments, args) if _writes(schema)]
        written += [kwargs[schema.name] for schema in func._schema.arguments if schema.name in kwargs
                    and _writes(schema)]
        storages = {_storage_key(t) for t in op_leaves(written) if isinstance(t, FakeTensor)}
        for key in [k for k, (_, storage, _) in self._values.items() if storage in storages]:
            self._values.pop(key, None)


def _writes(schema) -> bool:
    return schema.alias_info is not None and schema.alias_info.is_write


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _is_bookkeeping(t) -> bool:
    return (isinstance(t, FakeTensor) and t.device.type != "cpu" and t.dtype in _BOOKKEEPING_DTYPES
            and t.numel() <= SHADOW_MAX_NUMEL)


def reattributed(message: str) -> str:
    """``message`` (a :class:`~.fake_device.FakeRunError`'s) naming our caller's line where it names this module's
    (``our_frame`` sees this module's frames as ours): the innermost frame of this package outside this module
    and the fake device's own modules; inside :func:`dit21_forward`, the stand-in's line follows."""
    ours = [f for f in traceback.extract_stack() if f.filename.startswith(_PACKAGE)
            and not f.filename.endswith(FAKE_DEVICE_FILES)]
    caller = next((f for f in reversed(ours) if f.filename != __file__), None)
    standin = next((f for f in reversed(ours) if f.filename == __file__ and f.name == "dit21_forward"), None)
    if caller is None:
        return message
    where = f"{os.path.relpath(caller.filename, os.path.dirname(_PACKAGE))}:{caller.lineno} ({caller.name})"
    if standin is not None:
        where += f" (in DiffSynth's 2.1 DiT forward, run by fakegpu/standin21.py:{standin.lineno})"
    here = re.escape(os.path.relpath(__file__, os.path.dirname(_PACKAGE)))
    return re.sub(here + r":\d+ \(\w+\)", lambda _: where, message, count=1)


def _host_mask(values: Callable, mask: torch.Tensor) -> torch.Tensor:
    host = values(mask)
    if host is None:
        raise FakeRunError(reattributed(
            f"the Qwen-Image-2.1 DiT's reference-slot mask has no host values at {our_frame()}: it must be made "
            "on the host (the cache, the prompt encoder) and moved to the device"))
    return host.to("cpu")


def rope_rows(rope, img_shapes, image_pad_mask: torch.Tensor, device) -> torch.Tensor:
    """``QwenImage21Rope.forward(img_shapes, image_pad_mask, device)``, its position lists built on the host by
    DiffSynth's own code run over identity tables (row ``i`` holds ``i``), so it returns each token's row in
    each axis table; the device gathers those rows from the real tables."""
    from diffsynth.models.qwen_image_21_dit import QwenImage21Rope

    identity = SimpleNamespace(freqs=[torch.arange(f.shape[0], device="cpu")[:, None] for f in rope.freqs])
    rows = QwenImage21Rope.forward(identity, img_shapes, image_pad_mask, torch.device("cpu"))
    rope.freqs = [freq.to(device) for freq in rope.freqs]  # as DiffSynth's forward keeps them (line 430)
    rows = rows.to(device)
    return torch.cat([freq[rows[:, axis]] for axis, freq in enumerate(rope.freqs)], dim=-1)


def dit21_forward(self, hidden_states, encoder_hidden_states, timestep, img_shapes, img_mask,
                  encoder_hidden_states_mask=None, kv_cache=None, template_kv_cache=None, controlnet=None,
                  control_context=None, control_scale=1.0, use_gradient_checkpointing=False,
                  use_gradient_checkpointing_offload=False, use_flex_attention=False, *, host_values: Callable):
    """``QwenImage21DiT.forward`` with the mask bookkeeping on the host (module docstring); ``host_values(t)``
    gives a mask's host values (:meth:`HostShadows.values`)."""
    import diffsynth.models.qwen_image_21_dit as d21
    from diffsynth.core.gradient import gradient_checkpoint_forward

    device = hidden_states.device
    batch_size = hidden_states.shape[0]
    hidden_states = self.img_in(hidden_states)
    encoder_hidden_states = self.txt_in(encoder_hidden_states)

    # (553-565) the joint sequence: text rows where the mask is False, image tokens (4 per slot) where it is True
    slots = _host_mask(host_values, img_mask)[0]
    repeats = torch.where(slots, 4, 1)
    image_pad_mask = torch.repeat_interleave(slots, repeats)
    rows = torch.repeat_interleave(torch.arange(slots.shape[0], device="cpu"), repeats)
    rows[image_pad_mask] = encoder_hidden_states.shape[1] + torch.arange(int(image_pad_mask.sum()), device="cpu")
    joint_hidden_states = torch.cat([encoder_hidden_states, hidden_states.to(encoder_hidden_states.dtype)], dim=1)
    joint_hidden_states = joint_hidden_states.index_select(1, rows.to(device))

    rotary_emb = rope_rows(self.pos_embed, img_shapes[0], image_pad_mask, device)  # (567)
    image_ids, target_token_mask = self.build_token_metadata(image_pad_mask, img_shapes[0])  # host (568)
    target_on_device = target_token_mask.to(device)

    timestep = timestep.to(hidden_states.dtype)
    if self.causal_condition:
        timestep = torch.cat([timestep, timestep.new_zeros(1)], dim=0)
        modulation_mask = target_on_device
    else:
        modulation_mask = None
    temb = self.time_text_embed(timestep, hidden_states)
    modulation = self.modulation(temb)

    if kv_cache is not None and not self.causal_condition:
        raise ValueError("kv_cache requires `causal_condition=True`; otherwise the condition prefix depends on the "
                         "changing target latent across denoising steps.")
    if kv_cache is not None and len(kv_cache) != len(self.transformer_blocks):
        raise ValueError(f"kv_cache must contain one dictionary per transformer block; got {len(kv_cache)} for "
                         f"{len(self.transformer_blocks)} blocks.")

    joint_key_valid = None
    if encoder_hidden_states_mask is not None:  # (591-597) by integer positions made on the host
        joint_key_valid = torch.ones(batch_size, image_pad_mask.shape[0], dtype=torch.bool, device=device)
        text_positions = (~image_pad_mask).nonzero(as_tuple=True)[0]
        vlm_text_positions = (~slots[: encoder_hidden_states_mask.shape[1]]).nonzero(as_tuple=True)[0]
        joint_key_valid[:, text_positions.to(device)] = encoder_hidden_states_mask.bool().index_select(
            1, vlm_text_positions.to(device))

    prefix_len = int((~target_token_mask).sum())  # a host value
    is_decode = kv_cache is not None and len(kv_cache[0]) > 0
    cache_write_slice = None if is_decode or kv_cache is None else slice(0, prefix_len)
    segments = None
    if is_decode:
        joint_hidden_states = joint_hidden_states[:, prefix_len:]
        rotary_emb = rotary_emb[prefix_len:]
        modulation_mask = modulation_mask[prefix_len:]
        attention_mask = None if joint_key_valid is None else joint_key_valid[:, None, None, :]
    elif use_flex_attention and d21.FLEX_ATTN_AVAILABLE and not template_kv_cache:
        attention_mask = d21.build_qwenimage21_block_causal_mask(image_ids.to(device), joint_key_valid, batch_size,
                                                                 device)
    else:
        attention_mask = None
        segments = d21._qwenimage21_prefix_segments(image_ids, prefix_len)

    control_hints = None
    if controlnet is not None and control_context is not None:
        if kv_cache is not None:
            raise ValueError("The ControlNet branch recomputes its conditioning at every step, which is incompatible "
                             "with the prefix KV cache.")
        control_hints = controlnet(
            joint_hidden_states, control_context, image_positions=target_on_device, modulation=modulation,
            rotary_emb=rotary_emb, attention_mask=attention_mask, target_token_mask=modulation_mask,
            segments=segments, key_valid=joint_key_valid, control_scale=control_scale,
            use_gradient_checkpointing=use_gradient_checkpointing,
            use_gradient_checkpointing_offload=use_gradient_checkpointing_offload)

    for index_block, block in enumerate(self.transformer_blocks):
        block_kv_cache = kv_cache[index_block] if kv_cache is not None else None
        block_template_kv = None if template_kv_cache is None else template_kv_cache.get(f"block_{index_block}")
        joint_hidden_states = gradient_checkpoint_forward(
            block, use_gradient_checkpointing, use_gradient_checkpointing_offload,
            hidden_states=joint_hidden_states, modulation=modulation, rotary_emb=rotary_emb,
            attention_mask=attention_mask, target_token_mask=modulation_mask, kv_cache=block_kv_cache,
            cache_write_slice=cache_write_slice, segments=segments, key_valid=joint_key_valid,
            template_kv=block_template_kv)
        if control_hints is not None and index_block in control_hints:
            joint_hidden_states = joint_hidden_states + control_hints[index_block].to(joint_hidden_states.device,
                                                                                      joint_hidden_states.dtype)

    joint_hidden_states = self.norm_out(joint_hidden_states, temb, modulation_mask)
    return self.proj_out(joint_hidden_states)


@contextlib.contextmanager
def host_bookkeeping21() -> Iterator[HostShadows]:
    """Run Qwen-Image-2.1's DiT with the host bookkeeping of the module docstring: enter inside
    ``FakeCuda()`` (its shadows see the masks made there); ``QwenImage21DiT.forward`` is DiffSynth's again
    on exit."""
    from diffsynth.models.qwen_image_21_dit import QwenImage21DiT

    shadows = HostShadows()
    saved = QwenImage21DiT.__dict__["forward"]
    QwenImage21DiT.forward = functools.partialmethod(dit21_forward, host_values=shadows.values)
    try:
        with shadows:
            yield shadows
    finally:
        QwenImage21DiT.forward = saved


# the template around a 2.1 prompt: "<|im_start|>user\n"; "<imageN><|vision_start|>" ... "<|vision_end|>"; the
# assistant turn
TEMPLATE_HEAD, REF_MARKERS, TEMPLATE_TAIL = 3, 3, 5


def slot_mask21(ref_latent_sizes: Sequence[tuple[int, int]], prompt_tokens: int) -> torch.Tensor:
    """A 2.1 prompt's reference-slot mask ``[L]`` on the host, laid out as DiffSynth's 2.1 prompt encoder
    gives it after the dropped system turn: the user turn's head, per reference its markers around one slot per
    2x2 latents, the prompt's tokens, the assistant turn (the marker counts are the template's, rounded)."""
    mask = [False] * TEMPLATE_HEAD
    for h, w in ref_latent_sizes:
        if (h * w) % 4:
            raise ValueError(f"a 2.1 reference latent of {h}x{w} has no whole 2x2 slots; use image sides in "
                             "multiples of 32 px")
        mask += [False] * (REF_MARKERS - 1) + [True] * (h * w // 4) + [False]
    return torch.tensor(mask + [False] * (prompt_tokens + TEMPLATE_TAIL), dtype=torch.bool, device="cpu")


def kv_cache_bytes(caches) -> int:
    """Bytes of the prefix KV caches in ``caches`` (``Cond21._caches`` values: one list of block dicts each)."""
    return sum(t.numel() * t.element_size() for cache in caches for block in cache for t in block.values())


def kv_bytes_per_prefix_token(dit) -> int:
    """Keys and values of one prefix token in every block: 2 x blocks x inner width x the DiT's bytes."""
    p = next(dit.parameters())
    return 2 * len(dit.transformer_blocks) * dit.inner_dim * p.element_size()


"""The tiny model's text side: its sizes, Qwen's special tokens, and a tokenizer/processor built at run time.

A byte-level BPE trained with ``tokenizers`` and wrapped as ``Qwen2Tokenizer``, plus a
``Qwen2VLProcessor``; both built with the installed transformers, because folders
saved by transformers 4.x and 5.x don't load in the other. ``build.py`` builds the
models and writes everything to disk.
"""
from __future__ import annotations

import inspect
import json
import tempfile
from pathlib import Path

TEXT_SIZES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, mrope_section=[2, 3, 3],
                  vocab_size=384)
VISION_SIZES = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                    patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                    out_hidden_size=32, window_size=112, fullatt_block_indexes=[1])
PROCESSOR_PIXELS = dict(min_pixels=56 * 56, max_pixels=128 * 128)

# Qwen's special tokens. They are the BPE trainer's special tokens, so they get the
# ids 0..N-1 in this order; the text-encoder config below depends on these ids.
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
    "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
    "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>",
]
TOKEN_ID = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}

# Training text for the BPE merges: everyday editing vocabulary, deliberately *not*
# the pipeline's prompt templates. A small vocabulary that has not memorised the
# templates tokenizes them into more tokens than the real tokenizer does, so the
# templates stay longer than the pipeline's drop_idx (34 / 64) and prompt
# embeddings never come out empty.
_CORPUS = [
    "make the red circle blue", "turn the green square yellow", "change the background to white",
    "remove the small triangle", "add a black border around the image", "make the sky darker",
    "replace the blue ball with a red cube", "move the object to the left side of the picture",
    "change the color of the dress in figure 1 to the color shown in figure 2",
    "the quick brown fox jumps over the lazy dog", "a photo of a cat sitting on a wooden table",
    "Picture 1: Picture 2: keep everything else unchanged", "brighter, sharper, softer, larger, smaller",
    "orange purple pink gray white black red green blue yellow", "circle square triangle star heart",
]


# --- tokenizer / processor -------------------------------------------------------
def build_tokenizer():
    """A byte-level BPE trained on a small corpus, wrapped as ``Qwen2Tokenizer``."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
    from transformers import AddedToken, Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    bpe = Tokenizer(models.BPE())
    # Same pre-tokenization as Qwen2Tokenizer, so the learnt merges apply identically.
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(
        vocab_size=TEXT_SIZES["vocab_size"], special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    bpe.train_from_iterator(_CORPUS, trainer)
    model = json.loads(bpe.to_str())["model"]
    vocab = model["vocab"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    assert all(vocab[t] == i for t, i in TOKEN_ID.items())
    assert len(vocab) <= TEXT_SIZES["vocab_size"]
    kwargs = dict(unk_token=None, bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                  model_max_length=131072)
    if "vocab_file" in inspect.signature(Qwen2Tokenizer.__init__).parameters:
        # transformers 4.x: the (slow) Qwen2Tokenizer reads vocab.json + merges.txt.
        with tempfile.TemporaryDirectory() as tmp:
            vocab_file, merges_file = Path(tmp) / "vocab.json", Path(tmp) / "merges.txt"
            vocab_file.write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
            merges_file.write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
            tok = Qwen2Tokenizer(str(vocab_file), str(merges_file), **kwargs)
    else:  # transformers 5.x: a tokenizers-backed class built from vocab + merges
        tok = Qwen2Tokenizer(vocab=vocab, merges=merges, **kwargs)
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS], special_tokens=True)
    assert all(tok.convert_tokens_to_ids(t) == i for t, i in TOKEN_ID.items())
    return tok


def build_processor(tokenizer):
    """``Qwen2VLProcessor`` with small pixel limits (the video processor is required by transformers)."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    image_processor = Qwen2VLImageProcessor(**PROCESSOR_PIXELS, patch_size=VISION_SIZES["patch_size"],
                                            merge_size=VISION_SIZES["spatial_merge_size"],
                                            temporal_patch_size=VISION_SIZES["temporal_patch_size"])
    return Qwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                            video_processor=Qwen2VLVideoProcessor())

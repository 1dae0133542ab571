"""The generated models' tokenizer: a SentencePiece-style ("llama") vocabulary with byte fallback.

<unk>, <s>, </s>, 256 <0xXX> byte tokens, "▁", single characters, then common English words with
every prefix (an SPM vocab merges two symbols only when their concatenation is itself a token, so
without the prefixes nothing merges). Presets that ask for a larger vocab are padded with unique
NORMAL pieces "▁" + four Greek letters: valid tokens the model may sample, which detokenize to
valid UTF-8, but which tokenizing text never produces (no single Greek letter and no two-symbol
piece of them is in the vocab, so nothing can merge into them; Greek text falls back to bytes).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import gguf

UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
#: token ids of the 256 byte-fallback tokens <0x00>..<0xFF>
BYTE_TOKEN_IDS = range(3, 3 + 256)
SPACE = "\u2581"  # '▁', SentencePiece's word-boundary marker

_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?;:'\"-()"
_WORDS_TEXT = (
    "the of and to in is it that was for on are with as be at by this had not but from or have an "
    "they which one you were her all she there would their we him been has when who will more no "
    "if out so said what up its about into than them can only other new some could time these two "
    "may then do first any my now such like our over man me even most made after also did many "
    "before must through back years where much your way well down should because each just those "
    "people how too little state good very make world still own see men work long get here between "
    "both life being under never day same another know while last might us great old year off come "
    "since against go came right used take three hello token expert router sparse decode sample"
)
#: the vocabulary's English words (each with every prefix): text of them tokenizes into whole words
WORDS = _WORDS_TEXT.split()
# Greek lowercase without final sigma: 24 letters -> 24**4 = 331,776 padding pieces available
_PAD_ALPHABET = "".join(chr(c) for c in range(0x03B1, 0x03CA) if c != 0x03C2)
_PAD_LEN = 4


@dataclass(frozen=True)
class Vocab:
    tokens: list[str]
    scores: list[float]
    types: list[int]
    n_base: int  # tokens before padding; ids >= n_base are padding pieces


def build_vocab(n_vocab_min: int = 0) -> Vocab:
    """SPM ('llama') vocab with byte fallback, padded to at least ``n_vocab_min`` entries."""
    T = gguf.TokenType
    tokens: list[str] = []
    scores: list[float] = []
    types: list[int] = []
    seen: set[str] = set()

    def add(text: str, score: float, ty: gguf.TokenType) -> None:
        if text in seen:
            raise AssertionError(f"duplicate token {text!r}")
        seen.add(text)
        tokens.append(text)
        scores.append(float(score))
        types.append(int(ty))

    add("<unk>", 0.0, T.UNKNOWN)
    add("<s>", 0.0, T.CONTROL)
    add("</s>", 0.0, T.CONTROL)
    for b in range(256):
        add(f"<0x{b:02X}>", 0.0, T.BYTE)
    add(SPACE, -1.0, T.NORMAL)
    for i, c in enumerate(_CHARS):
        add(c, -2.0 - i * 1e-3, T.NORMAL)  # below merged pieces, so merges win
    for w in WORDS:
        for piece in (SPACE + w, w):
            for k in range(2, len(piece) + 1):
                pre = piece[:k]
                if pre not in seen:
                    add(pre, -1.0 + 0.1 * len(pre), T.NORMAL)  # longer pieces preferred
    n_base = len(tokens)

    n_pad = max(0, n_vocab_min - n_base)
    if n_pad > len(_PAD_ALPHABET) ** _PAD_LEN:
        raise ValueError(f"n_vocab_min={n_vocab_min} is larger than this generator can pad to")
    for letters in itertools.islice(itertools.product(_PAD_ALPHABET, repeat=_PAD_LEN), n_pad):
        add(SPACE + "".join(letters), -1000.0, T.NORMAL)
    return Vocab(tokens, scores, types, n_base)

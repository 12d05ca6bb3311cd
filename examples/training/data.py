"""Text files and token ids: reading UTF-8 text files with errors that name the file, the line and the
byte; DataError, the one error type for bad input (files, their content, or flags that contradict them),
raised before training starts; TokenArray, the ids of many sentences in one flat array; and the on-disk
token cache, so a resumed or repeated run does not tokenize the same text again."""
import hashlib
import os

import numpy as np


class DataError(ValueError):
    """Bad input (files, their content, or flags that contradict them), reported before training starts."""


def decode_lines(data, what):
    """The lines of UTF-8 bytes (line endings and a leading BOM dropped); DataError naming `what`, the line
    and the byte when they are not valid UTF-8."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise DataError(f"{what} is not valid UTF-8 text: line {line}, byte {column} is 0x{data[e.start]:02x} "
                        f"({e.reason}); convert it to UTF-8 (e.g. with iconv)") from None
    if text.startswith("\ufeff"):
        text = text[1:]
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [s[:-1] if s.endswith("\r") else s for s in lines]


def read_lines(path, what):
    """The lines of a UTF-8 text file. Raises DataError when the file is missing, is not a file, holds no
    non-blank line, or is not valid UTF-8 (naming the line and byte)."""
    if not os.path.exists(path):
        raise DataError(f"{what}: file not found: {path}")
    if not os.path.isfile(path):
        raise DataError(f"{what}: {path} is not a regular file")
    with open(path, "rb") as f:
        lines = decode_lines(f.read(), f"{what}: {path}")
    if not any(s.strip() for s in lines):
        raise DataError(f"{what}: {path} is empty (no non-blank line)")
    return lines


def file_digest(path, algorithm="sha1"):
    """Hex digest of a file's bytes, read in chunks (the token cache's key uses sha1; checkpoints record
    their tokenizer's sha256)."""
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


class TokenArray:
    """Token ids of many sentences in one flat int32 array: sentence i is flat[offsets[i]:offsets[i+1]]."""

    def __init__(self, flat, offsets):
        self.flat, self.offsets = flat, offsets
        self.lengths = np.diff(offsets)

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return self.flat[self.offsets[i]:self.offsets[i + 1]]

    @classmethod
    def from_lists(cls, ids):
        lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
        offsets = np.zeros(len(ids) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        flat = np.fromiter((t for x in ids for t in x), dtype=np.int32, count=int(offsets[-1]))
        return cls(flat, offsets)

    def subset(self, keep):
        return TokenArray.from_lists([self[i] for i in keep])


def encode_cached(sp, spm_path, lines, text_path, cache_dir):
    """Token ids of `lines` (read from `text_path`), cached in `cache_dir` under a key made of the
    tokenizer and the file's content, so a resumed or repeated run does not tokenize again."""
    key = hashlib.sha1((file_digest(spm_path) + file_digest(text_path)).encode()).hexdigest()[:20]
    cache = os.path.join(cache_dir, f"{os.path.basename(text_path)}.{key}.npz")
    if os.path.isfile(cache):
        with np.load(cache) as z:
            return TokenArray(z["flat"], z["offsets"])
    arr = TokenArray.from_lists(sp.encode(lines))
    os.makedirs(cache_dir, exist_ok=True)
    tmp = cache + ".tmp"  # a file object: np.savez would append .npz to the name
    with open(tmp, "wb") as f:
        np.savez(f, flat=arr.flat, offsets=arr.offsets)
    os.replace(tmp, cache)
    return arr

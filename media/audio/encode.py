"""Encode mono float audio to wav / flac / mp3 / opus / ogg / pcm (s16le) bytes, whole or as a
stream of chunks, through libsndfile (`soundfile`).

Streaming: `StreamEncoder.write` returns the bytes ready so far, so a server can send audio
while later sentences are still being synthesized. WAV is streamed with a header whose sizes say
"unknown length" (0xFFFFFFFF, what OpenAI's endpoint does); libsndfile formats are written into a
sink that hands out bytes as soon as the encoder emits them (header patches libsndfile makes at
close, e.g. FLAC's total sample count, cannot reach bytes already sent; decoders accept that).
Opus only takes 8/12/16/24/48 kHz, so other rates are resampled (soxr) to 48 kHz.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_OPUS_RATES = (8000, 12000, 16000, 24000, 48000)
# compressed containers with no audio frames are unreadable; an empty input gets this much silence
_EMPTY_SILENCE_S = 0.05


class UnsupportedFormatError(ValueError):
    """The audio format is unknown, or the installed libsndfile cannot encode it."""


@dataclass(frozen=True)
class AudioFormat:
    """How one response/file format is written."""

    name: str
    media_type: str
    sf_format: str | None = None  # None: written by us (wav stream header, raw pcm)
    sf_subtype: str | None = None
    # FLAC's STREAMINFO length is only known at close and libsndfile cannot read a FLAC
    # stream without it, so FLAC is emitted whole at close
    streamable: bool = True
    # MP3 is constant-bitrate: without the VBR tag LAME fills in at close, libsndfile (and
    # other decoders) estimate a VBR stream's length from its first frame and stop early
    bitrate_mode: str | None = None
    compression_level: float | None = None  # soundfile applies bitrate_mode only with this


_FORMATS = (
    AudioFormat("wav", "audio/wav", "WAV", "PCM_16"),
    AudioFormat("flac", "audio/flac", "FLAC", "PCM_16", streamable=False),
    AudioFormat(
        "mp3", "audio/mpeg", "MP3", "MPEG_LAYER_III", bitrate_mode="CONSTANT", compression_level=0.5
    ),
    AudioFormat("opus", "audio/ogg", "OGG", "OPUS"),
    AudioFormat("ogg", "audio/ogg", "OGG", "VORBIS"),
    AudioFormat("pcm", "audio/L16", None, None),
)
FORMAT_NAMES = tuple(f.name for f in _FORMATS)
_NO_ENCODER = {"aac": "libsndfile has no AAC encoder", "m4a": "libsndfile has no AAC encoder"}


def audio_format(name: str) -> AudioFormat:
    """Look up a format by name and check the installed libsndfile can write it."""
    key = name.lower().lstrip(".")
    if key in _NO_ENCODER:
        raise UnsupportedFormatError(
            f"{key} output is not supported ({_NO_ENCODER[key]}); "
            f"use one of {', '.join(FORMAT_NAMES)}"
        )
    fmt = next((f for f in _FORMATS if f.name == key), None)
    if fmt is None:
        raise UnsupportedFormatError(
            f"unknown audio format {name!r}; use one of {', '.join(FORMAT_NAMES)}"
        )
    if fmt.sf_format is not None:
        import soundfile as sf

        if fmt.sf_subtype not in sf.available_subtypes(fmt.sf_format):
            raise UnsupportedFormatError(
                f"this libsndfile ({sf.__libsndfile_version__}) cannot write {fmt.name}; "
                "mp3 and opus need libsndfile >= 1.1 (pip install -U soundfile)"
            )
    return fmt


def format_for_path(path: str | Path, override: str | None = None) -> AudioFormat:
    """The format named by `override`, else by the file suffix (`out.mp3` -> mp3)."""
    if override:
        return audio_format(override)
    suffix = Path(path).suffix.lower().lstrip(".")
    if not suffix:
        raise UnsupportedFormatError(f"{path}: no file suffix; pass --format")
    return audio_format({"oga": "ogg", "raw": "pcm"}.get(suffix, suffix))


def _int16(samples: np.ndarray) -> np.ndarray:
    x = np.clip(np.asarray(samples, dtype=np.float32).reshape(-1), -1.0, 1.0)
    return np.round(x * 32767.0).astype("<i2")


def _wav_stream_header(sample_rate: int) -> bytes:
    """RIFF/WAVE PCM16 mono header with 'unknown' (maximal) sizes, for streaming."""
    unknown = 0xFFFFFFFF
    fmt = struct.pack("<HHIIHH", 1, 1, sample_rate, sample_rate * 2, 2, 16)
    return (
        b"RIFF" + struct.pack("<I", unknown) + b"WAVE"
        + b"fmt " + struct.pack("<I", len(fmt)) + fmt
        + b"data" + struct.pack("<I", unknown)
    )  # fmt: skip


def _open_sf(target: object, fmt: AudioFormat, sample_rate: int):  # -> soundfile.SoundFile
    import soundfile as sf

    return sf.SoundFile(
        target,  # type: ignore[arg-type]
        "w",
        sample_rate,
        1,
        fmt.sf_subtype,
        format=fmt.sf_format,
        compression_level=fmt.compression_level,
        bitrate_mode=fmt.bitrate_mode,
    )


class _Sink(io.RawIOBase):
    """A seekable write target that hands out bytes once written and forgets them."""

    def __init__(self) -> None:
        super().__init__()
        self._buf = bytearray()
        self._base = 0  # absolute offset of _buf[0]; everything before it was handed out
        self._pos = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def write(self, data: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        data = bytes(data)
        start = self._pos
        skip = max(self._base - start, 0)  # a patch of bytes already sent is dropped
        if skip < len(data):
            at = start + skip - self._base
            end = at + len(data) - skip
            if end > len(self._buf):
                self._buf.extend(b"\0" * (end - len(self._buf)))
            self._buf[at:end] = data[skip:]
        self._pos = start + len(data)
        return len(data)

    def read(self, size: int = -1) -> bytes:
        at = max(self._pos - self._base, 0)
        end = len(self._buf) if size is None or size < 0 else at + size
        out = bytes(self._buf[at:end])
        self._pos += len(out)
        return out

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        size = self._base + len(self._buf)
        self._pos = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: size}[whence] + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def take(self) -> bytes:
        out = bytes(self._buf)
        self._base += len(out)
        self._buf.clear()
        return out


_MP3_KBPS = {
    3: (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320),  # MPEG-1
    2: (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),  # MPEG-2 (and 2.5)
}
_MP3_RATES = {3: (44100, 48000, 32000), 2: (22050, 24000, 16000), 0: (11025, 12000, 8000)}


def _mp3_frame_length(header: bytes) -> int | None:
    """Length of the Layer III frame starting with `header`, None if it is not one."""
    if len(header) < 4 or header[0] != 0xFF or (header[1] & 0xE0) != 0xE0:
        return None
    version, layer = (header[1] >> 3) & 3, (header[1] >> 1) & 3
    kbps_index, rate_index, pad = header[2] >> 4, (header[2] >> 2) & 3, (header[2] >> 1) & 1
    if layer != 1 or version == 1 or rate_index == 3 or kbps_index in (0, 15):
        return None
    kbps = _MP3_KBPS[3 if version == 3 else 2][kbps_index]
    rate = _MP3_RATES[version][rate_index]
    return (144 if version == 3 else 72) * kbps * 1000 // rate + pad


def _strip_mp3_tag(data: bytes) -> bytes | None:
    """Drop LAME's leading Xing/Info tag frame: it is filled in at close, which a stream cannot
    do, and decoders given the unfilled frame stop early. None: need more bytes."""
    length = _mp3_frame_length(data[:4])
    if length is None:
        return data
    if len(data) < length:
        return None
    frame = data[:length]
    # at stream time the tag frame is still LAME's all-zero placeholder
    is_tag = not frame[4:].strip(b"\0") or b"Xing" in frame or b"Info" in frame
    return data[length:] if is_tag else data


class StreamEncoder:
    """Incremental encoder: `write(samples)` and `close()` return the next bytes of the file."""

    def __init__(self, fmt: AudioFormat | str, sample_rate: int) -> None:
        self.format = audio_format(fmt) if isinstance(fmt, str) else fmt
        self.input_rate = sample_rate
        self.output_rate = sample_rate
        if self.format.sf_subtype == "OPUS" and sample_rate not in _OPUS_RATES:
            self.output_rate = 48000
        self._header_sent = False
        self._pending = b""  # mp3 bytes held until the leading tag frame can be dropped
        self._sink: _Sink | io.BytesIO | None = None
        self._file = None
        self._resampler = None
        self._frames = 0
        if self.format.name not in ("wav", "pcm"):  # those two are streamed by hand
            self._sink = _Sink() if self.format.streamable else io.BytesIO()
            self._file = _open_sf(self._sink, self.format, self.output_rate)
        if self.output_rate != self.input_rate:
            import soxr

            self._resampler = soxr.ResampleStream(
                self.input_rate, self.output_rate, 1, dtype="float32"
            )

    def write(self, samples: np.ndarray) -> bytes:
        x = np.clip(np.asarray(samples, dtype=np.float32).reshape(-1), -1.0, 1.0)
        if self._resampler is not None:
            x = self._resampler.resample_chunk(x)
        return self._encode(x)

    def _encode(self, x: np.ndarray) -> bytes:
        if self._file is None:
            head = b""
            if self.format.name == "wav" and not self._header_sent:
                head = _wav_stream_header(self.output_rate)
            self._header_sent = True
            return head + _int16(x).tobytes()
        if len(x):
            self._file.write(x)
            self._frames += len(x)
        return self._take()

    def _take(self) -> bytes:
        if not isinstance(self._sink, _Sink):
            return b""
        out = self._sink.take()
        if self.format.name != "mp3" or self._header_sent:
            return out
        stripped = _strip_mp3_tag(self._pending + out)
        if stripped is None:
            self._pending += out
            return b""
        self._header_sent = True
        self._pending = b""
        return stripped

    def close(self) -> bytes:
        tail = b""
        if self._resampler is not None:
            tail = self._encode(self._resampler.resample_chunk(np.zeros(0, np.float32), last=True))
        if self._file is None:
            return tail + self._encode(np.zeros(0, np.float32))
        if self._frames == 0:
            tail += self._encode(np.zeros(int(self.output_rate * _EMPTY_SILENCE_S), np.float32))
        self._file.close()
        if isinstance(self._sink, io.BytesIO):
            return tail + self._sink.getvalue()
        return tail + self._take()


def encode(samples: np.ndarray, sample_rate: int, fmt: AudioFormat | str) -> bytes:
    """A complete file in memory, with exact sizes and tags (not the streaming variants)."""
    fmt = audio_format(fmt) if isinstance(fmt, str) else fmt
    if fmt.sf_format is None or fmt.sf_subtype == "OPUS":
        enc = StreamEncoder(fmt, sample_rate)
        return enc.write(samples) + enc.close()
    x = np.clip(np.asarray(samples, dtype=np.float32).reshape(-1), -1.0, 1.0)
    if len(x) == 0 and fmt.name != "wav":
        x = np.zeros(int(sample_rate * _EMPTY_SILENCE_S), np.float32)
    out = io.BytesIO()
    with _open_sf(out, fmt, sample_rate) as f:
        f.write(x)
    return out.getvalue()


def write_stream(
    path: str | Path, chunks: Iterable[np.ndarray], sample_rate: int, fmt: AudioFormat | str
) -> int:
    """Encode chunks into a file as they arrive (headers patched at close); samples written."""
    fmt = audio_format(fmt) if isinstance(fmt, str) else fmt
    total = 0
    if fmt.sf_format is not None and fmt.sf_subtype != "OPUS":
        with _open_sf(str(path), fmt, sample_rate) as f:
            for chunk in chunks:
                f.write(np.clip(np.asarray(chunk, dtype=np.float32).reshape(-1), -1.0, 1.0))
                total += len(chunk)
            if total == 0 and fmt.name != "wav":
                f.write(np.zeros(int(sample_rate * _EMPTY_SILENCE_S), np.float32))
        return total
    enc = StreamEncoder(fmt, sample_rate)
    with open(path, "wb") as f:
        for chunk in chunks:
            f.write(enc.write(chunk))
            total += len(chunk)
        f.write(enc.close())
    return total

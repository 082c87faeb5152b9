"""Text to espeak-ng IPA phonemes, grouped by sentence, the way Piper voices were trained.

espeak-ng comes from the `espeakng-loader` wheel (library + data, no system install). Its
`espeak_TextToPhonemes` returns one clause per call and drops punctuation, so the clause
terminator Piper keeps (`.`, `?`, `!`, `,`, `:`, `;`) is read back from the consumed text.
"""

from __future__ import annotations

import ctypes
import functools
import re
import threading
import unicodedata
from dataclasses import dataclass

# espeak_Initialize output mode: synchronous, we never play audio through espeak.
_AUDIO_OUTPUT_SYNCHRONOUS = 2
_CHARS_UTF8 = 1
_PHONEMES_IPA = 0x02
_TIE_FLAG = 0x80  # phoneme mode bit 7: bits 8-23 hold a tie character
_SENTENCE_END = frozenset(".?!")
_CLAUSE_END = frozenset(",:;")
# Long clauses are grouped into synthesis chunks no longer than this many phonemes (VITS attention
# is quadratic in length, and smaller chunks give earlier first audio).
MAX_CHUNK_PHONEMES = 400


class PhonemizerError(RuntimeError):
    """espeak-ng could not be loaded or rejected the voice."""


@dataclass(frozen=True)
class Sentence:
    """One synthesis unit: the phoneme characters of a sentence (NFD, punctuation kept)."""

    phonemes: tuple[str, ...]

    @property
    def text(self) -> str:
        return "".join(self.phonemes)


class _VoiceSpec(ctypes.Structure):
    # espeak_VOICE from speak_lib.h, for selecting a voice by language ("en-gb")
    _fields_ = [
        ("name", ctypes.c_char_p),
        ("languages", ctypes.c_char_p),
        ("identifier", ctypes.c_char_p),
        ("gender", ctypes.c_ubyte),
        ("age", ctypes.c_ubyte),
        ("variant", ctypes.c_ubyte),
        ("xx1", ctypes.c_ubyte),
        ("score", ctypes.c_int),
        ("spare", ctypes.c_void_p),
    ]


@dataclass
class _Espeak:
    lib: ctypes.CDLL
    lock: threading.Lock


@functools.cache
def _espeak() -> _Espeak:
    """Load and initialise libespeak-ng once per process (it is a process-global C library)."""
    try:
        import espeakng_loader
    except ImportError as exc:  # pragma: no cover - a declared dependency
        raise PhonemizerError("text to speech needs the `espeakng-loader` package") from exc
    lib = ctypes.CDLL(espeakng_loader.get_library_path())
    lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
    lib.espeak_Initialize.restype = ctypes.c_int
    lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
    lib.espeak_SetVoiceByName.restype = ctypes.c_int
    lib.espeak_SetVoiceByProperties.argtypes = [ctypes.POINTER(_VoiceSpec)]
    lib.espeak_SetVoiceByProperties.restype = ctypes.c_int
    lib.espeak_TextToPhonemes.argtypes = [
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.c_int,
        ctypes.c_int,
    ]
    lib.espeak_TextToPhonemes.restype = ctypes.c_char_p
    data = str(espeakng_loader.get_data_path()).encode()
    if lib.espeak_Initialize(_AUDIO_OUTPUT_SYNCHRONOUS, 0, data, 0) <= 0:
        raise PhonemizerError(f"espeak-ng failed to initialise with data at {data.decode()}")
    return _Espeak(lib, threading.Lock())


def _terminator(consumed: str) -> str:
    """The punctuation that ended a clause, read from the text espeak consumed.

    espeak reads one character ahead into the next clause, so trailing word characters and
    spaces are skipped first. An ellipsis is a pause, not a sentence end.
    """
    tail = consumed.rstrip()
    tail = re.sub(r"[^\s.?!,:;]+$", "", tail).rstrip()
    tail = re.sub(r"[\"')\]\u201d\u2019]+$", "", tail)
    if tail.endswith(".."):
        return ","
    if tail and tail[-1] in _SENTENCE_END | _CLAUSE_END:
        return tail[-1]
    return ""


_CURRENCY = re.compile(r"([$€£])(\d+(?:,\d{3})*)(?:\.(\d{2}))?\b")
_CURRENCY_NAMES = {"$": ("dollar", "cent"), "€": ("euro", "cent"), "£": ("pound", "penny")}


def _money(match: re.Match[str]) -> str:
    unit, sub = _CURRENCY_NAMES[match.group(1)]
    whole = match.group(2).replace(",", "")
    words = f"{whole} {unit}{'' if whole == '1' else 's'}"
    cents = match.group(3)
    if cents and int(cents):
        plural = "pence" if sub == "penny" else "cents"
        words += f" and {int(cents)} {sub if int(cents) == 1 else plural}"
    return words


def normalize_text(text: str) -> str:
    """Clean text before phonemization: unicode compatibility forms, typographic punctuation,
    currency amounts, control characters and runs of whitespace. espeak reads numbers,
    ordinals and years as words itself."""
    text = unicodedata.normalize("NFKC", text)
    text = text.translate(
        {0x2018: "'", 0x2019: "'", 0x201C: '"', 0x201D: '"', 0x2013: ", ", 0x2014: ", "}
    )
    text = text.replace("\u2026", "...")
    text = _CURRENCY.sub(_money, text)
    text = "".join(" " if unicodedata.category(c)[0] == "C" else c for c in text)
    return re.sub(r"\s+", " ", text).strip()


def _clauses(text: str, voice: str, mode: int = _PHONEMES_IPA) -> list[tuple[str, str]]:
    """(phonemes, terminator) for each clause espeak finds in `text`."""
    es = _espeak()
    raw = text.encode()
    out: list[tuple[str, str]] = []
    with es.lock:
        if es.lib.espeak_SetVoiceByName(voice.encode()) != 0 and (
            es.lib.espeak_SetVoiceByProperties(ctypes.byref(_VoiceSpec(languages=voice.encode())))
            != 0
        ):
            raise PhonemizerError(f"espeak-ng has no voice {voice!r}")
        buf = ctypes.create_string_buffer(raw)
        start = ctypes.addressof(buf)
        ptr = ctypes.c_void_p(start)
        while ptr.value:
            before = ptr.value - start
            result = es.lib.espeak_TextToPhonemes(ctypes.byref(ptr), _CHARS_UTF8, mode)
            after = ptr.value - start if ptr.value else len(raw)
            consumed = raw[before:after].decode("utf-8", errors="ignore")
            out.append(((result or b"").decode("utf-8", errors="ignore"), _terminator(consumed)))
    return out


def phonemize(text: str, voice: str = "en-us", tie: str | None = None) -> list[Sentence]:
    """Split `text` into sentences of Piper phonemes (espeak IPA, NFD, punctuation kept).

    Language-switch flags like `(fr)` are dropped; a clause ended by `,` `:` `;` gets a space
    after its terminator (Piper's training convention). Sentences longer than
    MAX_CHUNK_PHONEMES are cut at clause boundaries. `tie` joins the letters of multi-letter
    phonemes (`a^ɪ`), for voices whose symbols are whole phonemes (Kokoro).
    """
    mode = _PHONEMES_IPA | (_TIE_FLAG | ord(tie) << 8 if tie else 0)
    sentences: list[Sentence] = []
    current: list[str] = []
    for phonemes, term in _clauses(normalize_text(text), voice, mode):
        chars = re.sub(r"\([^)]+\)", "", phonemes).strip()
        if not chars and not current:
            continue
        if current and current[-1] != " " and chars:
            current.append(" ")
        piece = chars + term + (" " if term in _CLAUSE_END else "")
        current.extend(unicodedata.normalize("NFD", piece))
        if term in _SENTENCE_END or len(current) >= MAX_CHUNK_PHONEMES:
            sentences.append(Sentence(tuple(current)))
            current = []
    if any(c.strip() for c in current):
        sentences.append(Sentence(tuple(current)))
    return [s for s in sentences if any(c.isalpha() for c in s.phonemes)]

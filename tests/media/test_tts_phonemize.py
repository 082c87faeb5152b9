"""Phonemization through espeak-ng (espeakng-loader): Piper's IPA for known words, clause
punctuation, sentence splitting, numbers and currency read as words, degenerate input."""

import unicodedata

import pytest

from localllm.media.tts.phonemize import MAX_CHUNK_PHONEMES, normalize_text, phonemize

pytest.importorskip("espeakng_loader", reason="espeak-ng comes from the espeakng-loader wheel")


def texts(text: str, voice: str = "en-us") -> list[str]:
    return [unicodedata.normalize("NFC", s.text) for s in phonemize(text, voice)]


@pytest.mark.parametrize(
    ("text", "ipa"),
    [
        ("Hello world.", "həlˈoʊ wˈɜːld."),
        (
            "The quick brown fox jumps over the lazy dog.",
            "ðə kwˈɪk bɹˈaʊn fˈɑːks dʒˈʌmps ˌoʊvɚ ðə lˈeɪzi dˈɑːɡ.",
        ),
        ("I have 42 apples.", "aɪ hæv fˈɔːɹɾi tˈuː ˈæpəlz."),
    ],
)
def test_known_words(text: str, ipa: str) -> None:
    assert texts(text) == [ipa]


def test_sentences_split_and_clause_punctuation_kept() -> None:
    assert texts("Hi there. How are you? Fine, thanks!") == [
        "hˈaɪ ðˈɛɹ.",
        "hˈaʊ ɑːɹ juː?",
        "fˈaɪn, θˈæŋks!",
    ]


def test_phonemes_are_nfd_characters() -> None:
    # Piper's id map has combining marks as separate symbols, so composed characters must not appear
    sentence = phonemize("Naïve café.")[0]
    assert all(len(ch) == 1 for ch in sentence.phonemes)
    assert "".join(sentence.phonemes) == unicodedata.normalize("NFD", sentence.text)


def test_currency_and_whitespace_normalised() -> None:
    assert (
        normalize_text("It  costs $5.50,\tnot £1.")
        == "It costs 5 dollars and 50 cents, not 1 pound."
    )
    assert normalize_text("“quoted” — dash…") == '"quoted" , dash...'
    assert texts("It costs $3.") == ["ɪt kˈɔsts θɹˈiː dˈɑːlɚz."]


def test_british_voice_differs() -> None:
    assert texts("tomato.", "en-gb") != texts("tomato.", "en-us")


def test_unknown_voice_is_a_clear_error() -> None:
    from localllm.media.tts.phonemize import PhonemizerError

    with pytest.raises(PhonemizerError, match="no voice"):
        phonemize("hello", "xx-not-a-voice")


@pytest.mark.parametrize("text", ["", "   ", "\n\t", "\x00\x01"])
def test_nothing_to_say_gives_no_sentences(text: str) -> None:
    assert phonemize(text) == []


def test_emoji_only_does_not_crash() -> None:
    # espeak-ng reads emoji by name; whatever it says must be plain phonemes
    out = phonemize("😀 🎉")
    assert all(isinstance(ch, str) for s in out for ch in s.phonemes)


def test_run_on_text_is_cut_at_clause_boundaries() -> None:
    text = ", ".join(["the cat sat on the mat"] * 80) + "."
    out = phonemize(text)
    assert len(out) > 1
    # a chunk closes at the first clause end past the limit: never more than one clause over
    assert all(len(s.phonemes) < MAX_CHUNK_PHONEMES + 60 for s in out)
    joined = "".join(s.text for s in out)
    assert joined.count("kˈæt") == 80


def test_quotes_and_ellipsis() -> None:
    # a full stop inside closing quotes still ends the sentence; an ellipsis is a pause
    assert texts('He said "yes." Then he left.') == ["hiː sˈɛd jˈɛs.", "ðˈɛn hiː lˈɛft."]
    out = texts("Wait... what?")
    assert out == ["wˈeɪt, wˌʌt?"]

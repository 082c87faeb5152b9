"""Reading weights back out of an onnxruntime-quantized ONNX export (the form Kokoro's int8
release takes): a small torch module laid out like Kokoro's (`encoder.text_encoder.lstm`,
`encoder.bert_encoder`, `decoder.decoder.asr_res.0`) is exported with torch's TorchScript
exporter and quantized with `quantize_dynamic`, as the release was; our reader must give back the
float weights within int8 rounding (half a quantization step), in torch's layout and gate order.
"""

import numpy as np
import pytest
import torch
from torch import nn

from localllm.media.tts.kokoro.onnx_import import _module_path, read_kokoro_onnx
from localllm.media.tts.kokoro.prosody import BiLSTM


class _TextEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(16, 8, batch_first=True, bidirectional=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(x)[0]


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bert_encoder = nn.Linear(16, 16)
        self.text_encoder = _TextEncoder()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.text_encoder(self.bert_encoder(x))


class _Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.asr_res = nn.Sequential(nn.Conv1d(16, 8, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.asr_res(x.transpose(1, 2))


class _DecoderWrapper(nn.Module):  # the release's export nests the decoder once more
    def __init__(self) -> None:
        super().__init__()
        self.decoder = _Decoder()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(x)


class _Top(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = _Encoder()
        self.decoder = _DecoderWrapper()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    quantization = pytest.importorskip("onnxruntime.quantization")
    root = tmp_path_factory.mktemp("onnx_import")
    torch.manual_seed(0)
    model = _Top().eval()
    with torch.no_grad():  # LSTM weights spread over [-1, 1] so rounding is not everything
        for p in model.encoder.text_encoder.lstm.parameters():
            p.uniform_(-1, 1)
    torch.onnx.export(model, (torch.randn(1, 7, 16),), root / "f.onnx", dynamo=False)
    quantization.quantize_dynamic(root / "f.onnx", root / "q.onnx")
    return model, read_kokoro_onnx(root / "q.onnx")


def _step(w: torch.Tensor) -> float:
    return float(w.detach().max() - w.detach().min()) / 255  # int8: 256 levels over the range


def test_scope_names_map_to_checkpoint_keys() -> None:
    cases = {
        "/encoder/text_encoder/cnn.0/cnn.0.0/Conv_quant": "text_encoder.cnn.0.0",
        "/encoder/F0.1/conv1x1/Conv_quant": "predictor.F0.1.conv1x1",
        "/encoder/shared/LSTM_quant": "predictor.shared",
        "/encoder/bert/encoder/albert_layer_groups.0/albert_layers.0/attention/query_3/"
        "MatMul_quant": "bert.encoder.albert_layer_groups.0.albert_layers.0.attention.query",
        "/decoder/decoder/generator/resblocks.4/adain2.2/fc/Gemm_MatMul_quant": (
            "decoder.generator.resblocks.4.adain2.2.fc"
        ),
    }
    assert {scope: _module_path(scope) for scope in cases} == cases


def test_linear_conv_and_lstm_weights_come_back(exported) -> None:
    model, parts = exported
    linear = model.encoder.bert_encoder.weight
    got = parts["bert_encoder"]["weight"]
    assert got.shape == linear.shape
    assert (got - linear).abs().max() <= _step(linear) * 0.51 + 1e-6
    conv = model.decoder.decoder.asr_res[0].weight
    got = parts["decoder"]["asr_res.0.weight"]
    assert got.shape == conv.shape and (got - conv).abs().max() <= _step(conv) * 0.51 + 1e-6
    lstm = model.encoder.text_encoder.lstm.state_dict()
    assert set(parts["text_encoder"]) == {f"lstm.{k}" for k in lstm}
    for key, value in lstm.items():
        got = parts["text_encoder"][f"lstm.{key}"]
        assert got.shape == value.shape, key
        tol = 1e-6 if "bias" in key else _step(value) * 0.51 + 1e-6  # biases stay float
        assert (got - value).abs().max() <= tol, key


def test_imported_lstm_runs_like_the_original(exported) -> None:
    model, parts = exported
    ours = BiLSTM(16, 8)
    ours.load_state_dict({k.removeprefix("lstm."): v for k, v in parts["text_encoder"].items()})
    x = torch.randn(1, 9, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model.encoder.text_encoder.lstm(x)[0]
        got = ours(x)
    # int8 weights: outputs within a few percent; a wrong gate order is off by ~100 %
    err = float((got - expected).abs().max())
    assert err < 0.05, err
    assert np.isfinite(got.numpy()).all()

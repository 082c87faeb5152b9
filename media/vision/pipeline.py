"""`VisionPipeline`: an mmproj paired with a loaded text engine, turning images into prompt spans.

`prepare` (any thread: decode, bound, preprocess, hash) makes a `PreparedImage`; `chat` and
`completion` build the prompt ids and one `engine.multimodal.MultiModalInput` per image whose
encoder runs the tower on the engine's thread at prefill (once per content hash). The pairing is
checked when the pipeline is made: the projector's output width must be the text model's, and
the vocabulary must hold the family's image tokens, so an mmproj of another model is refused.
The processor takes the model's preprocessing settings (`preprocess_config`: the mmproj's keys,
a Hugging Face folder model's sidecar files, the caller's overrides) over its family defaults.
"""

import contextlib
import dataclasses
import importlib
import inspect
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from localllm.engine.hf import HFCheckpoint
from localllm.engine.multimodal import MultiModalInput
from localllm.kernels.cpu.onednn_fp32 import fast_fp32
from localllm.media.vision import preprocess_config as pconfig
from localllm.media.vision import prompt as vprompt
from localllm.media.vision.image import DEFAULT_LIMITS, ImageLimits, decode_image, image_digest
from localllm.media.vision.mmproj import FAMILIES, MMProjError, build_tower, open_mmproj
from localllm.media.vision.mmproj import projector_type as _kind
from localllm.media.vision.siglip import VisionConfigError
from localllm.media.vision.video import DEFAULT_LIMITS as DEFAULT_VIDEO
from localllm.media.vision.video import VideoError, VideoLimits, decode_video, video_digest


@dataclass(frozen=True, eq=False, slots=True)
class PreparedImage:
    pixels: torch.Tensor  # the processor's output (host, float32)
    layout: Any  # the family's tile layout
    num_tokens: int  # embeddings (placeholder tokens) it yields
    digest: str  # content hash: pixels + preprocessing + projector
    size: tuple[int, int]  # decoded width, height
    video: bool = False  # a video's frames (`prepare_video`), placed by a video part


class VisionPipeline:
    def __init__(
        self,
        path: str | os.PathLike,
        engine,
        device: torch.device | str | None = None,
        preprocess: dict[str, Any] | None = None,
    ):
        """`preprocess`: explicit settings (`preprocess_config.KEYS`) over the model's own."""
        self.path = os.fspath(path)
        g = open_mmproj(self.path)
        try:
            self.kind = _kind(g.metadata)
            dev = device if device is not None else engine.kv_cache.k[0].device
            self.model = build_tower(g, dev)
            settings = self._settings(g, engine, preprocess or {})
        except BaseException:
            g.close()
            raise
        self._gguf = g  # the weights are views of its mapping: open while the model lives
        self.device = torch.device(dev)
        mod = importlib.import_module(f"localllm.media.vision.{FAMILIES[self.kind]}_processor")
        takes = inspect.signature(mod.Processor).parameters
        if any(p.kind is p.VAR_KEYWORD for p in takes.values()):  # passes them to its base
            takes = inspect.signature(mod.Processor.__mro__[1]).parameters
        given = {k: v for k, v in settings.items() if k in pconfig.PROCESSOR_KEYS}
        refused = sorted(set(preprocess or {}) & set(given) - set(takes))
        if refused:
            raise MMProjError(f"{self.path}: a {self.kind} projector takes no {refused}")
        self.processor = mod.Processor(
            self.model.args, **{k: v for k, v in given.items() if k in takes}
        )
        self.settings = settings  # what the model (and the caller) set, for docs and tests
        self.video_sampling = {
            pconfig.SAMPLING_KEYS[k]: v for k, v in settings.items() if k in pconfig.SAMPLING_KEYS
        }
        self._check_pair(engine)

    @staticmethod
    def _settings(g, engine, preprocess: dict[str, Any]) -> dict[str, Any]:
        """The mmproj's settings, a Hugging Face folder model's sidecars', then `preprocess`."""
        try:
            out = pconfig.from_mmproj(g.metadata)
            if isinstance(getattr(engine, "gguf", None), HFCheckpoint):
                out.update(pconfig.from_folder(engine.gguf.path))
            out.update(pconfig.check(preprocess))
        except VisionConfigError as e:
            raise MMProjError(f"{g.path}: {e}") from None
        return out

    def _check_pair(self, engine) -> None:
        if hasattr(self.processor, "rope") and not getattr(engine.model, "mrope", False):
            raise MMProjError(
                f"{self.path}: this {self.kind} projector needs a text model with M-RoPE "
                f"(qwen2vl), not {engine.model.args.arch}: it belongs to another model"
            )
        want, have = self.model.args.out_dim, engine.model.args.dim
        if want != have:
            raise MMProjError(
                f"{self.path}: this projector makes {want}-wide embeddings but the model's are "
                f"{have} wide: it belongs to another model"
            )
        tok = engine.tokenizer
        ids = {}
        for text in self.processor.special_tokens:
            got = tok.encode(text, add_special=False, parse_special=True)
            if len(got) != 1:
                raise MMProjError(
                    f"{self.path}: the model's vocabulary has no {text!r} token, which this "
                    f"{self.kind} projector needs: it belongs to another model"
                )
            ids[text] = got[0]
        self.image_token = self.processor.image_token  # what the chat template writes
        # the tokens whose embeddings an image replaces (Gemma 3: soft tokens, not the marker)
        self.image_token_id = ids[getattr(self.processor, "embed_token", self.image_token)]
        video = getattr(self.processor, "video_token", None)
        self.video_token_id = ids.get(video)  # None: a video's tokens are image tokens

    def prepare(self, data: bytes, limits: ImageLimits = DEFAULT_LIMITS) -> PreparedImage:
        """Decode and preprocess one image (CPU work: call it off the event loop)."""
        img = decode_image(data, limits)
        pixels, layout = self.processor.preprocess(img)
        digest = image_digest(img, f"{self.kind}|{self.processor.salt}")
        return PreparedImage(
            torch.from_numpy(np.ascontiguousarray(pixels)),
            layout,
            self.processor.num_tokens(layout),
            digest,
            img.size,
        )

    def prepare_video(self, data: bytes, limits: VideoLimits = DEFAULT_VIDEO) -> PreparedImage:
        """Decode, sample (the family's way) and preprocess one video (CPU work)."""
        proc = self.processor
        if not hasattr(proc, "preprocess_video"):
            raise VideoError(f"the {self.kind} vision projector does not take video")
        limits = dataclasses.replace(limits, **self.video_sampling)  # the model's sampling
        v = decode_video(data, limits, sampler=getattr(proc, "sample_frames", None),
                         resize=getattr(proc, "video_frame_size", None))  # fmt: skip
        pixels, layout = proc.preprocess_video(v)
        return PreparedImage(
            torch.from_numpy(np.ascontiguousarray(pixels)),
            layout,
            proc.num_tokens(layout),
            video_digest(v, f"{self.kind}|{proc.salt}"),
            (v.source[1], v.source[0]),  # the file's width, height
            video=True,
        )

    def encode(self, image: PreparedImage) -> torch.Tensor:
        """The image's embeddings [num_tokens, dim] (runs the tower here and now; on a CPU its
        float32 matmuls through oneDNN where that is float32 math: 1.74x the tower's speed on
        the 2026-12-06 Zen 5, `kernels.cpu.onednn_fp32`)."""
        cpu = self.device.type == "cpu"
        with torch.inference_mode(), fast_fp32() if cpu else contextlib.nullcontext():
            if getattr(self.model, "takes_grid", False):  # Qwen: the patch grid too
                return self.model(image.pixels.to(self.device), image.layout.thw)
            if getattr(self.model, "takes_layout", False):  # LLaVA-1.6: its tile grid
                return self.model(image.pixels.to(self.device), image.layout)
            return self.model(image.pixels.to(self.device))

    def encoder(self, image: PreparedImage) -> Callable[[], torch.Tensor]:
        return lambda: self.encode(image)

    def chat(
        self, engine, messages: Sequence[dict], images: Sequence[PreparedImage], **render_kw: Any
    ) -> tuple[list[int], list[MultiModalInput]]:
        """Prompt ids and image spans of a conversation whose `{"type": "image"}` parts stand
        for `images`, in order (`render_kw`: `LLMEngine.render_chat`'s keywords)."""
        n, nv = vprompt.count_images(messages), vprompt.count_images(messages, "video")
        if n + nv != len(images) or nv != sum(im.video for im in images):
            raise ValueError(
                f"the messages have {n} image and {nv} video parts for {len(images)} inputs"
            )
        video = getattr(self.processor, "video_token", None)
        text = vprompt.render(engine, messages, self.image_token, n, video, **render_kw)
        return self._spans(engine, text, images, engine.encode_chat)

    def completion(
        self, engine, text: str, images: Sequence[PreparedImage]
    ) -> tuple[list[int], list[MultiModalInput]]:
        """A raw prompt (no chat template) with the images placed before its text."""
        if self.image_token in text:
            raise ValueError(f"the prompt contains {self.image_token!r}, the image placeholder")
        return self._spans(engine, self.image_token * len(images) + text, images, engine.tokenize)

    def _spans(self, engine, text, images, encode) -> tuple[list[int], list[MultiModalInput]]:
        holders = [self.processor.placeholder(im.layout) for im in images]
        video = getattr(self.processor, "video_token", None)
        wrapper = getattr(self.processor, "video_wrapper", None)
        if wrapper:  # Qwen3-VL: a video's placeholder brings its own start/end markers
            text = text.replace(wrapper, video)
        ids = encode(vprompt.expand(text, self.image_token, holders, video))
        targets = {self.image_token_id, self.video_token_id} - {None}
        where = vprompt.spans(ids, targets, [im.num_tokens for im in images])
        items = []
        for im, pos in zip(images, where, strict=True):
            items += self._items(im, pos)
        return ids, items

    def _items(self, im: PreparedImage, pos: tuple[int, ...]) -> list[MultiModalInput]:
        """One input per span: the whole image, or each segment of a video whose placeholder
        is cut by text (Qwen3-VL's timestamps), each a slice of one encoding."""
        rope = getattr(self.processor, "rope", None)  # M-RoPE families: grid positions
        grid = dict(zip(("rope", "rope_advance"), rope(im.layout), strict=True)) if rope else {}
        split = getattr(self.processor, "segments", None)
        sizes = split(im.layout) if split else None
        if not sizes:
            return [MultiModalInput(im.digest, pos, encoder=self.encoder(im), **grid)]
        memo: list[torch.Tensor] = []

        def part(a: int, b: int) -> torch.Tensor:
            if not memo:  # the first segment a step reaches encodes the whole video
                memo.append(self.encode(im))
            return memo[0][a:b]

        out, a = [], 0
        for k, n in enumerate(sizes):
            enc = lambda a=a, b=a + n: part(a, b)
            out.append(MultiModalInput(f"{im.digest}#{k}", pos[a : a + n], encoder=enc, **grid))
            a += n
        return out

    def close(self) -> None:
        self._gguf.close()

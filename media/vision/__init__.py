"""Vision: images into the engine through mmproj vision towers (DESIGN §6 "Vision").

`image` decodes and bounds input images; `mmproj` opens a projector GGUF and builds its family's
tower (towers `siglip`, `clip`; families `idefics3`, `gemma3`, `llava`, `qwen25vl`, ...); each
family's `*_processor` module preprocesses exactly as the Hugging Face image processor and lays
out its placeholder tokens; `pipeline.VisionPipeline` ties them to an engine: prompt ids with the
image spans, and the encoder run at prefill.
"""

"""Tokenizers and chat templates built from GGUF metadata.

- `Tokenizer.from_gguf_metadata(meta)`: byte-level BPE (`gpt2`) and SentencePiece-style (`llama`)
  vocabularies, token for token as llama.cpp tokenizes them.
- `IncrementalDetokenizer`: streaming ids -> text without broken UTF-8.
- `ChatTemplate`: the GGUF's jinja chat template in a bounded sandbox.
"""

from localllm.engine.tokenizer.chat_template import CHATML_TEMPLATE, ChatTemplate, ChatTemplateError
from localllm.engine.tokenizer.detokenizer import IncrementalDetokenizer
from localllm.engine.tokenizer.tokenizer import Tokenizer
from localllm.engine.tokenizer.vocab import Vocab, VocabError

__all__ = [
    "CHATML_TEMPLATE",
    "ChatTemplate",
    "ChatTemplateError",
    "IncrementalDetokenizer",
    "Tokenizer",
    "Vocab",
    "VocabError",
]

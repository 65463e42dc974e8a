"""Text <-> token ids for every checkpoint format we load, chat templates, streaming decode.

1. `Tokenizer.from_path` (`core`) looks at what it is given: a `.gguf` file (its `tokenizer.*`
   metadata is read with `gguf.GGUFReader` and handed to step 2), or a directory (or the file
   itself) holding `tokenizer.json` (Hugging Face `tokenizers`; preferred) or `tokenizer.model`
   (`sentencepiece`) (`backends`). Side files in the same directory -- `tokenizer_config.json`,
   `special_tokens_map.json`, `generation_config.json`, `chat_template.jinja` /
   `chat_template.json` -- supply the special tokens, the BOS/EOS rule, the end-of-generation ids
   and the chat template (`files`).
2. `Tokenizer.from_gguf_metadata` rebuilds the tokenizer a GGUF describes (`gguf_vocab`). A "gpt2"
   vocabulary becomes a byte-level BPE `tokenizers.Tokenizer` (vocab + merges from the file, split
   regex chosen by `tokenizer.ggml.pre`); a "llama" vocabulary becomes a SentencePiece BPE
   `ModelProto` built from tokens, scores and token types. Control (3) and user-defined (4) tokens
   are matched whole in the text.
3. `encode` runs the backend (special tokens are recognised whole) and adds BOS/EOS by the
   checkpoint's rule: explicit `add_bos_token`/`add_eos_token` flags win; a `tokenizer.json`
   without them keeps its own post-processor.
4. `decode` maps ids back to bytes and then to UTF-8 text, optionally dropping special tokens.
5. `apply_chat_template` renders the checkpoint's own Jinja template in a sandbox, with
   `bos_token`/`eos_token`/`raise_exception`/`tojson` available as in Hugging Face
   (`chat_template`).
6. `IncrementalDetokenizer` / `StreamDetokenizer` turn a stream of generated ids into text deltas,
   never releasing half a UTF-8 character (`detokenizer`). A few prompt ids seed the window, so
   SentencePiece's "▁" on the first generated token reads as the space it is rather than being
   stripped as the start of a text.
"""

from jaxinfer.tokenizer.core import Tokenizer
from jaxinfer.tokenizer.detokenizer import IncrementalDetokenizer, StreamDetokenizer
from jaxinfer.tokenizer.errors import TokenizerError

__all__ = [
    "IncrementalDetokenizer",
    "StreamDetokenizer",
    "Tokenizer",
    "TokenizerError",
]

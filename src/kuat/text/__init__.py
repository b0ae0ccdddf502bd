"""The language-model input path: pack documents into rows, batch by tokens, tokenize.

| module | what it is | when it runs |
|---|---|---|
| `_docs.py` | documents of an epoch by ordinal (token ids, labels / loss mask), fetched again by ordinal | inside the packer |
| `pack/` | `pack()`: concat / first-fit / best-fit packing over a bounded buffer, a `Stream` with a small resumable state; with the documents' lengths every consumer plans the same rows and reads only its own; `kuat_state_at` / `kuat_iter_from`: the loader's resume hooks. Its docstring maps its modules: the API, the plan (who packs what), the pure strategies | each `iter()`, in the loader's workers; `kuat_state_at` in `loader.state_dict()` |
| `collate.py` | `pack_collate()`: rows -> batch with `cu_seqlens`, `max_seqlen`, `document_ids`; `document_mask`, `flex_block_mask` | every batch (masks: on the device) |
| `tokenize.py` | one interface over `tokenizers` / `transformers` / `tiktoken`; chat samples with a loss mask; `tokenize()`: a stream tokenized on the fly | ingest (`kuat.convert.from_text`) or each `iter()` |
| `storage.py` | `token_storage()`: bytes per stored token, split into token values, per-document offsets and file framing | on demand (`kuat demo --text`, the text bench) |
| `budget.py` | `TokenBudgetBatchSampler`: batches bounded by padded tokens, length-bucketed, equal counts per rank | each epoch, in the loader's main thread |

``kuat.pad_collate`` (``kuat/padding.py``) pads unpacked samples.
"""

from kuat.text.budget import TokenBudgetBatchSampler, lengths_of
from kuat.text.collate import PackCollate, document_mask, flex_block_mask, pack_collate
from kuat.text.pack import STRATEGIES, Packed, PackIterator, pack
from kuat.text.storage import token_storage
from kuat.text.tokenize import Tokenizer, as_tokenizer, encode_chat, load_tokenizer, tokenize

__all__ = [
    "STRATEGIES",
    "TokenBudgetBatchSampler",
    "Tokenizer",
    "as_tokenizer",
    "encode_chat",
    "load_tokenizer",
    "tokenize",
    "PackCollate",
    "PackIterator",
    "Packed",
    "document_mask",
    "flex_block_mask",
    "lengths_of",
    "pack",
    "pack_collate",
    "token_storage",
]

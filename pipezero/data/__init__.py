"""Text in, token windows out: corpus discovery, tokenizers, and layout-independent batches."""

from pipezero.data.batches import global_batch, heldout_batches, microbatches_for_rank, unigram_entropy
from pipezero.data.corpus import Corpus, load_corpus, stdlib_files, write_stdlib_sample
from pipezero.data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "global_batch", "heldout_batches", "microbatches_for_rank", "unigram_entropy",
    "Corpus", "load_corpus", "stdlib_files", "write_stdlib_sample",
    "BPETokenizer", "ByteTokenizer", "Tokenizer", "load_tokenizer",
]

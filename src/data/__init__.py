"""Training data: load it, recognise its shape, check it, split it and tokenize it, once, before training.

The result is a `DatasetDict` (train / validation / test) saved to disk under a key of everything that determines it
(source files, tokenizer, stage, lengths, column mapping, split sizes, seed). One process per machine builds it under
a file lock while the others wait on the lock, not on a collective, so a long tokenization cannot run into NCCL's
timeout; every rank then memory-maps the same files (one Arrow file per split), which also keeps TRL's reference
log-prob precomputation working under several processes.

Tokenization mirrors what TRL's trainers do themselves (same helpers, same prompt/completion boundary, same EOS
rules; `tests/test_data.py` checks the ids are identical), so the trainers receive ready columns and skip it.

Preparation streams: the source stays in memory-mapped Arrow files, splits are carved as row indices, and one
batched `datasets.map` per chunk normalizes, checks and tokenizes (on --dataset_num_proc processes) into int32 id
columns written to disk batch by batch; the kept rows are then streamed from those files into each split's file with
plain reads, never through a memory map (a mapped page once read stays in the resident set), so peak memory follows
the batch size, not the data size (`bench/bench_prepare.py` measures it; docs/data.md has the numbers).

One module per concern, in the order preparation meets them:

- sources.py       where the data comes from (the embedded default, a path, the Hub), its columns, prompts alone
- files.py         every file kind `datasets` reads, each unreadable one refused in one line; a row's file and line
- mixtures.py      --dataset_mixture: one source each, their prepared splits mixed
- shapes.py        the shape recognised from the columns and first row; column mapping; a row normalised
- templates.py     what a tokenizer's chat template can render; chat messages checked against it
- checks.py        a row's check (empty, identical) and the status it leaves preparation with
- tokenization.py  a row to token ids as TRL's trainers make them
- splits.py        train / validation / test
- rows.py          the tokenizing map's function and the Arrow features in and out
- pool.py          the map on --dataset_num_proc processes, in chunks with progress
- pair_audit.py    what the pairs can teach, from the columns the map writes anyway (the data audit's numbers)
- kto.py           KTO's classes and KL partners
- prepared.py      the prepared directory's files, written and memory-mapped (`PreparedData`)
- cache_key.py     the prepared data's key
- prepare.py       `prepare_data`: all of the above, once per machine
- summary.py       the console lines about the prepared data
- errors.py        DataError

What other modules import from the data is named here; the rest is each module's own.
"""

from src.data.cache_key import prepared_path
from src.data.errors import DataError
from src.data.kto import kl_partners
from src.data.mixtures import mixture_sources, source_names
from src.data.prepare import prepare_data
from src.data.prepared import SUMMARY_FILE, PreparedData, source_rows
from src.data.shapes import normalize_row, parse_label
from src.data.sources import check_source, prompts_only, source_columns, source_fingerprint, source_location
from src.data.summary import format_summary
from src.data.tokenization import sample_fields, tokenize_preference, tokenize_reward, tokenize_sft, tokenize_unpaired
from src.data_file_kinds import source_files
from src.objectives import PROMPTS  # the prompts-alone shape, which the rounds prepare under its own name

__all__ = ["DataError", "PROMPTS", "PreparedData", "SUMMARY_FILE", "check_source", "format_summary", "kl_partners",
           "mixture_sources", "normalize_row", "parse_label", "prepare_data", "prepared_path", "prompts_only",
           "sample_fields", "source_columns", "source_files", "source_fingerprint", "source_location", "source_names",
           "source_rows", "tokenize_preference", "tokenize_reward", "tokenize_sft", "tokenize_unpaired"]

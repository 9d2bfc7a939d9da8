"""Conversations over one compressed document (the `kvcli chat` REPL on top of them: kvcli/apps/chat_repl.py).

`Conversation(...)` is the conversation of the mode its arguments choose, each a class of its own over a shared
base (kvcli/apps/chat_base.py: the turn format, the fields, the cache bookkeeping, the reporting rows):

    compressed once   CompressedOnce (kvcli/apps/chat_once.py): question-agnostic; QuestionKnown (the same file,
                      `question` given): question-aware, compressed for the question known before the document is read
    re-selected       Reselected (kvcli/apps/chat_reselected.py, reselect=True), its form's class once the document
                      is read: ReselectedExact (the same file), the document's full cache stored whole;
                      ReselectedBounded (kvcli/apps/chat_bounded.py), stored in chunks and streamed per question

`Conversation.from_kvc` loads a compressed-once .kvc file, `Conversation.from_store` a stored full cache or a bounded
store folder, with the compression the command built for the model `store_model` names.

A `Conversation` owns one sequence of a NativeSession. Its cache holds:

    [ compressed prefix                 ][ turn ][ turn ] ...
      system + document (+ question)       each turn appends; nothing is recompressed

Prompt layout (see docs/terminal.md):

- question-aware (a question is known before compressing: `--question`, or the first message
  given on the command line): the prefix is the whole first prompt, the question after the
  document in the same user turn, then the assistant header, as the papers do. The policy's
  observation window therefore covers the question.
- question-agnostic (no question yet): the prefix is the user turn holding the document followed
  by GENERIC_SUFFIX, a neutral instruction that becomes the observation window (kvpress's
  question-agnostic setting: compress the context alone, ask afterwards). Each question is then
  a new user turn appended after the compressed prefix.

- re-selected (the default of `kvcli chat` with a compressing policy; kvcli/drivers/reselect.py): the document's full
  cache is read once and stored in a file; every question is answered from a cache compressed for it. The prompt
  of a question is the whole conversation, laid out as `run` lays out one question:

      [ system, user: document + first question ][ assistant: answer ][ user: question ] ... [ user: new question ]

  restored from the stored document (less its last STORE_TAIL tokens, or the policy's window), the rest (the
  document's end, the earlier
  turns, the new question) prefilled with observation, and the whole compressed to the budget by the policy,
  the new question's window scoring every entry: earlier turns are compressed with the document (they compete
  for the budget like any entry; the queries of a follow-up attend to them, so what it refers to is kept).
  The conversation's turns are kept in the stored full cache: each re-selection keeps the whole prompt's full cache
  (before compacting it) beside the stored document, in memory (StoredDocument.extension), and the next question
  restores it and prefills only what is new, the last answer (generated over the compressed cache, so not in the
  full cache) and the new question, or the policy's window when that is longer; a prompt that does not start with
  it restores from the document (exact either way: tests/test_reselect.py). /reset and --fresh drop the kept turns;
  `kvcli run`'s several questions, each asked alone, keep none (`store_turns`).

Turns are templated with the model's own chat template: the text between turns is read off
renderings of probe conversations (TurnFormat), so any template llama.cpp applies works.
`/reset` removes every cell after the prefix (`session.truncate` at the prefix's end position: llama_memory_seq_rm
in the native engine), which the native patch keeps consistent with the slot bias.
"""
from kvcli.apps.chat_base import (AGNOSTIC, AWARE, MEMORY_STATS, RESELECTED, ContextFullError, Conversation, Turn,
                                  TurnFormat, user_content)
from kvcli.apps.chat_once import CompressedOnce, QuestionKnown
from kvcli.apps.chat_reselected import Reselected, ReselectedExact, store_model
from kvcli.apps.chat_bounded import ReselectedBounded

__all__ = ["AGNOSTIC", "AWARE", "MEMORY_STATS", "RESELECTED", "CompressedOnce", "ContextFullError", "Conversation",
           "QuestionKnown", "Reselected", "ReselectedBounded", "ReselectedExact", "Turn", "TurnFormat", "store_model",
           "user_content"]

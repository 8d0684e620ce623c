"""Full-text search over one session: an incremental BM25 index.

Written here rather than taken from a library: the engine adds one document per message
as it arrives and must never rebuild the index per turn (``rank_bm25`` and friends build
their statistics once over a fixed corpus), and it needs scores for chosen documents
(relevance-first assembly ranks only the middle band). The index is an inverted map
``term -> {doc: term frequency}`` with document lengths; adding a document is linear in
its length, a query in the postings of its terms.

Scoring is Okapi BM25 (k1 = 1.2, b = 0.75) with the non-negative IDF
``ln(1 + (N - n + 0.5) / (n + 0.5))``. Terms are lower-cased runs of letters and digits
(any script); identifiers such as ``order_id-4411`` also index their whole form. Chinese,
Japanese and Korean text has no spaces between words, so a run of its characters is
indexed as each character and each pair of neighbours, as full-text engines do (Lucene's
CJK bigrams): ``退款`` then finds the sentence it is written in.
"""

from __future__ import annotations

import heapq
import math
import re
from collections.abc import Iterable

__all__ = ["Bm25Index", "terms"]

_WORD = re.compile(r"\w+", re.UNICODE)
#: Han (with its extensions, compatibility forms and marks such as 々), kana (not its
#: punctuation, such as ・) and Hangul syllables
_CJK = (
    "\u3005-\u3007\u3041-\u309f\u30a1-\u30fa\u30fc-\u30ff\u3400-\u4dbf\u4e00-\u9fff"
    "\uac00-\ud7a3\uf900-\ufaff\uff66-\uff9f\U00020000-\U0003134f"
)
_HAS_CJK = re.compile(f"[{_CJK}]")
#: a run of CJK characters (group 1), or a run of the other letters and digits
_RUNS = re.compile(f"([{_CJK}]+)|[^\\W{_CJK}]+", re.UNICODE)
# alphanumeric runs joined by single separators: unambiguous, so matching stays linear
_COMPOUND = re.compile(r"[^\W_]+(?:[-_.:/][^\W_]+)+", re.UNICODE)
_EDGES = "\"'()[]{}<>,;!?`*"
_COMPOUND_MAX = 64
#: the most terms of a query that are scored (its rarest in the index)
QUERY_TERMS = 64
K1 = 1.2
B = 0.75


def terms(text: str) -> list[str]:
    """The index terms of a text: its words (CJK as characters and pairs), and its
    compound identifiers whole."""
    lowered = text.lower()
    if lowered.isascii() or not _HAS_CJK.search(lowered):
        found = _WORD.findall(lowered)
    else:
        found = _split(lowered)
    for chunk in lowered.split():
        if len(chunk) <= _COMPOUND_MAX and not chunk.isalnum():
            stripped = chunk.strip(_EDGES).rstrip(".:")
            if _COMPOUND.fullmatch(stripped):
                found.append(stripped)
    return found


def _split(lowered: str) -> list[str]:
    """The words of a text with CJK in it: each CJK run as its characters and the pairs
    of neighbours, the runs of other letters and digits as they are."""
    found: list[str] = []
    for match in _RUNS.finditer(lowered):
        run = match[0]
        if match[1] is None:
            found.append(run)
        else:
            found += run
            found += [run[i : i + 2] for i in range(len(run) - 1)]
    return found


class Bm25Index:
    """Documents by id, added once (re-adding an id is ignored), ranked by BM25."""

    __slots__ = ("_lengths", "_postings", "_total")

    def __init__(self) -> None:
        self._postings: dict[str, dict[str, int]] = {}
        self._lengths: dict[str, int] = {}
        self._total = 0

    def __len__(self) -> int:
        return len(self._lengths)

    def __contains__(self, doc: object) -> bool:
        return doc in self._lengths

    def add(self, doc: str, text: str) -> None:
        """Index ``text`` as document ``doc``."""
        if doc in self._lengths:
            return
        words = terms(text)
        self._lengths[doc] = len(words)
        self._total += len(words)
        counts: dict[str, int] = {}
        for word in words:
            counts[word] = counts.get(word, 0) + 1
        postings = self._postings
        for word, count in counts.items():
            bucket = postings.get(word)
            if bucket is None:
                postings[word] = {doc: count}
            else:
                bucket[doc] = count

    def _weights(self, query: str) -> list[tuple[dict[str, int], float]]:
        """The postings and IDF of the query's terms the index holds: the
        :data:`QUERY_TERMS` rarest of them, so a query the size of a document (a pasted
        log, a model's runaway tool call) costs what a long one does, not a scan of every
        document for each of its words."""
        n = len(self._lengths)
        weights = []
        for word in dict.fromkeys(terms(query)):
            bucket = self._postings.get(word)
            if bucket:
                idf = math.log(1 + (n - len(bucket) + 0.5) / (len(bucket) + 0.5))
                weights.append((bucket, idf))
        if len(weights) > QUERY_TERMS:  # the most telling ones, in the query's order
            kept = sorted(range(len(weights)), key=lambda i: -weights[i][1])[:QUERY_TERMS]
            weights = [weights[i] for i in sorted(kept)]
        return weights

    def _score(self, doc: str, weights: list[tuple[dict[str, int], float]], mean: float) -> float:
        length = self._lengths.get(doc, 0)
        norm = K1 * (1 - B + B * length / mean) if mean else K1
        score = 0.0
        for bucket, idf in weights:
            tf = bucket.get(doc)
            if tf:
                score += idf * tf * (K1 + 1) / (tf + norm)
        return score

    def search(self, query: str, limit: int = 10) -> list[tuple[str, float]]:
        """The best ``limit`` documents for ``query``, best first; ties break by document
        id, so results are deterministic.

        The documents holding the query's rarer terms are scored first. A document that
        holds none of them scores less than what the commoner terms can add at most
        (each less than ``idf * (K1 + 1)``), so once the ``limit``-th best score found
        passes that, the commoner terms' documents are not read: a query with one rare
        word among common ones ("the", "and") reads the rare word's documents, not every
        document of a long session."""
        weights = self._weights(query)
        if not weights or limit < 1:
            return []
        mean = self._total / len(self._lengths)
        rarest = sorted(weights, key=lambda weight: -weight[1])
        reach = [0.0] * (len(rarest) + 1)  # what the terms from i on can add at most
        for i in range(len(rarest) - 1, -1, -1):
            reach[i] = reach[i + 1] + rarest[i][1] * (K1 + 1)
        scored: dict[str, float] = {}
        best: list[float] = []  # the ``limit`` best scores so far, the least first
        for i, (bucket, _) in enumerate(rarest):
            if len(best) == limit and best[0] > reach[i]:
                break  # no document left unread can reach the results
            for doc in bucket:
                if doc in scored:
                    continue
                score = scored[doc] = self._score(doc, weights, mean)
                if len(best) < limit:
                    heapq.heappush(best, score)
                elif score > best[0]:
                    heapq.heapreplace(best, score)
        return heapq.nsmallest(limit, scored.items(), key=lambda item: (-item[1], item[0]))

    def scores(self, query: str, docs: Iterable[str]) -> dict[str, float]:
        """BM25 of each of ``docs`` for ``query`` (0.0 for a document without its terms)."""
        weights = self._weights(query)
        mean = self._total / len(self._lengths) if self._lengths else 0.0
        return {doc: self._score(doc, weights, mean) if weights else 0.0 for doc in docs}

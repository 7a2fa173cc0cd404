"""How many guesses a key would take someone who knows how people make readable keys.

A zxcvbn-family estimator (Wheeler, USENIX Security 2016) for one decision: does a key
without a namespace carry at least 100 bits. Matchers find words and names, dates and
years, keyboard walks, repeats, sequences, zero-padded counters and separators; each
part costs log2 of zxcvbn's guesses, every other character brute force, and the
estimate is the cheapest cover (a weighted interval scheduling over the savings).

Two departures from zxcvbn:

- Brute force is log2 of the key's alphanumeric alphabet a character (26, 36, 52 or 62),
  log2(33) a symbol, log2(14) a separator, so every uuid4 and ``token_hex(16)`` clears
  100 bits with room to spare; digits alone between separators cost their decimal value.
- Readable parts (words, separators, sequences, repeats of readable parts, keyboard
  walks, counters) count for at most ``READABLE_CAP_BITS`` together: a phrase of many
  words is not a random key, and ``invoice-`` before a uuid4 costs nothing. Dates and
  numbers are not readable (random digits often make one).

Pure and deterministic (the word list is read at import). It runs on every request
with a key outside a namespace, so matchers work on whole-key operations, and
``estimate_below`` first tries a bound that settles most random keys.
"""

from __future__ import annotations

import math
import re
from bisect import bisect_right
from collections.abc import Callable
from functools import lru_cache
from importlib.resources import files
from operator import itemgetter, le, ne

__all__ = ["READABLE_CAP_BITS", "estimate_below", "guessing_bits"]

#: The most that the readable parts of a key add to its estimate, however many.
READABLE_CAP_BITS = 50.0

_LOG2_10 = math.log2(10)
_SYMBOL_BITS = math.log2(33)
_SEPARATORS = "-_.:/\\|@#=+,;~"
_SEPARATOR_BITS = math.log2(len(_SEPARATORS))
#: zxcvbn's floor for a part that is not the whole key: 10 guesses for one character,
#: 50 for more, so that a cover made of many tiny parts still costs something.
_MIN_MANY_BITS = math.log2(50)
#: log2 of the alphabet's size, by its size (26, 36, 52, 62; 10 for digits alone).
_ALPHABET_BITS = {size: math.log2(size) for size in (10, 26, 36, 52, 62)}
#: By the alphabet's size (0: no letters or digits): a character's brute force, and the
#: most one covered character of the key can save (a symbol's, if that is more).
_CHARACTER_BITS = {
    size: (bits, max(bits, _SYMBOL_BITS))
    for size, bits in {**_ALPHABET_BITS, 0: _SYMBOL_BITS}.items()
}

# The shape of a key, one character for each: lowercase "a", uppercase "A", digit "0",
# separator "-", any other character "!".
_SHAPE = str.maketrans(
    {
        chr(c): (
            "a"
            if chr(c).islower()
            else "A"
            if chr(c).isupper()
            else "0"
            if chr(c).isdigit()
            else "-"
            if chr(c) in _SEPARATORS
            else "!"
        )
        for c in range(128)
    }
)
#: ``_SHAPE`` as a table for ``bytes.translate`` (of ASCII: every other byte is "!").
_SHAPE_BYTES = bytes(ord(_SHAPE[c]) if c < 128 else ord("!") for c in range(256))

# --- dictionary -----------------------------------------------------------------------


def _load_words() -> tuple[dict[str, int], frozenset[str], int]:
    """(word -> rank, 1 for the most common; the first three letters of every word;
    the longest word's length). The file's words follow its header and a blank line."""
    text = files(__package__).joinpath("keyguess_words.txt").read_text("ascii")
    words = text.partition("\n\n")[2].split()
    # Reversed, so that a word listed twice keeps its better (first) rank.
    ranks = dict(zip(reversed(words), range(len(words), 0, -1), strict=True))
    return ranks, frozenset(word[:3] for word in words), max(map(len, words))


_WORDS, _WORD_STARTS, _LONGEST_WORD = _load_words()
#: Three letters or more (written out, not [a-z]{3,}: a pattern that starts with a set
#: lets the regular expression engine skip to where it can match).
_LETTER_RUN = re.compile(r"[a-z][a-z][a-z]+")


def _case_bits(token: str) -> tuple[float, bool]:
    """zxcvbn's uppercase variations of a word as written, in bits, and whether the word
    reads as written text (all lower, all upper or capitalised)."""
    if token.islower():
        return 0.0, True
    if token.isupper() or (token[0].isupper() and token[1:].islower()):
        return 1.0, True
    upper = sum(map(str.isupper, token))
    n = len(token)
    return math.log2(sum(math.comb(n, i) for i in range(1, min(upper, n - upper) + 1))), False


# --- differences between neighbours ---------------------------------------------------
# Sequences, runs and keyboard walks are found in the neighbours' code differences, all
# at once on one integer: byte i is 128 + code[i + 1] - code[i] (no borrow: ASCII).

_OFFSETS: dict[int, tuple[int, int]] = {}


def _offsets(lanes: int) -> tuple[int, int]:
    """(128 in each of ``lanes`` bytes, a mask of those bytes)."""
    known = _OFFSETS.get(lanes)
    if known is None:
        mask = (1 << (8 * lanes)) - 1
        known = (mask // 0xFF * 0x80, mask)
        if lanes < 256:  # every key's length, and no more
            _OFFSETS[lanes] = known
    return known


def _differences(number: int, n: int) -> bytes:
    """128 + codes[i + 1] - codes[i] for every i < n - 1, ``number`` being the ``n``
    7-bit codes as the bytes of one integer (``int.from_bytes(codes, "little")``)."""
    lanes = n - 1
    offsets, mask = _offsets(lanes)
    return ((number >> 8) + offsets - (number & mask)).to_bytes(lanes, "little")


_SAME = 128  # a difference of 0: the same character again
#: A key's code is 32 * row + 2 * column + its row's start + 1 (below 128), so that a
#: neighbour's code differs by 2 (left, right) or 32 +- 1 (the rows above and below);
#: 0 is no key. The six differences, in zxcvbn's order of directions.
_DIRECTIONS = {-2: 0, -33: 1, -31: 2, 2: 3, 33: 4, 31: 5}
_STEP_SIZES = (1, -1, 2, -2, 3, -3, 4, -4, 5, -5)
#: In the differences of the key's codes, each alternative led by one byte so that the
#: engine skips to where one can start: one apart three times in a row, or 2 to 5 apart
#: four times (zxcvbn's sequences, 5 apart at most); the same character three times.
_STEPS = re.compile(
    b"|".join(
        [re.escape(bytes([128 + d])) * (2 if abs(d) == 1 else 3) + b"+" for d in _STEP_SIZES]
        + [re.escape(bytes([_SAME])) * 2 + b"+"]
    )
)
#: In the differences of the key's keys' codes: three steps to a neighbouring key in a
#: row, a walk over four keys at least.
_WALK = re.compile(b"[" + re.escape(bytes(128 + d for d in _DIRECTIONS)) + b"]{3,}")
#: Those differences as 1, every other as 0 (for ``bytes.translate``): where no three 1s
#: stand in a row, there is no walk to look for.
_NEIGHBOURS = bytes(int(c - 128 in _DIRECTIONS) for c in range(256))


def _sequence_bits(token: str, descending: bool) -> float:
    first = token[0]
    base = 4 if first in "aAzZ019" else 10 if first.isdigit() else 26
    return math.log2(base * len(token) * (2 if descending else 1))


# --- keyboard walks (qwerty, shifted and not) -----------------------------------------

_QWERTY_ROWS = (
    ("`~", "1!", "2@", "3#", "4$", "5%", "6^", "7&", "8*", "9(", "0)", "-_", "=+"),
    ("qQ", "wW", "eE", "rR", "tT", "yY", "uU", "iI", "oO", "pP", "[{", "]}", "\\|"),
    ("aA", "sS", "dD", "fF", "gG", "hH", "jJ", "kK", "lL", ";:", "'\""),
    ("zZ", "xX", "cC", "vV", "bB", "nN", "mM", ",<", ".>", "/?"),
)
#: Where each row starts, in half key widths: "q" sits between "1" and "2".
_ROW_STARTS = (0, 3, 4, 5)
_KEY_CODES = bytes(
    next(
        (
            32 * row + 2 * column + _ROW_STARTS[row] + 1
            for row, keys in enumerate(_QWERTY_ROWS)
            for column, key in enumerate(keys)
            if chr(c) in key
        ),
        0,
    )
    for c in range(256)
)
_SHIFTED = frozenset(key[1] for row in _QWERTY_ROWS for key in row)
_KEY_STARTS = 2 * sum(map(len, _QWERTY_ROWS))  # every character, shifted or not
#: How many neighbours a key has, on average over the keyboard.
_KEY_DEGREE = sum(
    abs(_KEY_CODES[ord(a[0])] - _KEY_CODES[ord(b[0])]) in (2, 31, 33)
    for keys in _QWERTY_ROWS
    for a in keys
    for row in _QWERTY_ROWS
    for b in row
) / sum(map(len, _QWERTY_ROWS))


def _walk_bits(token: str, turns: int) -> float:
    """zxcvbn's guesses for a keyboard walk over ``len(token)`` keys with ``turns`` turns."""
    guesses = 0.0
    n = len(token)
    for i in range(2, n + 1):
        for j in range(1, min(turns, i - 1) + 1):
            guesses += math.comb(i - 1, j - 1) * _KEY_STARTS * _KEY_DEGREE**j
    shifted = sum(c in _SHIFTED for c in token)
    if shifted in (0, n):
        variations = 2 if shifted else 1
    else:
        variations = sum(math.comb(n, i) for i in range(1, min(shifted, n - shifted) + 1))
    return math.log2(guesses * variations)


# --- repeats --------------------------------------------------------------------------

_ZEROS = {size: bytes(size) for size in (2, 3, 4)}
#: For each size of part, the shift that lays a key's codes on those ``size`` places on,
#: and the run of NULs that marks, in their XOR, a part said twice (``_short_repeats``).
_REPEAT_MARKS = tuple((8 * size, "\x00" * size) for size in (2, 3, 4))


# --- dates, years, numbers ------------------------------------------------------------

#: zxcvbn weighs a year by its distance from the present; no clock is read here, so the
#: present is this constant. It only matters to within a few years.
_REFERENCE_YEAR = 2026
_MIN_YEAR_SPACE = 20
_DATE_MIN_YEAR = 1000
_DATE_MAX_YEAR = 2050
#: Where 4 to 8 digits may be cut into day, month and year (zxcvbn's splits).
_DATE_SPLITS = {
    4: ((1, 2), (2, 3)),
    5: ((1, 3), (2, 3)),
    6: ((1, 2), (2, 4), (4, 5)),
    7: ((1, 3), (2, 3), (4, 5), (4, 6)),
    8: ((2, 4), (4, 6)),
}
_LOG2_DAYS = math.log2(365)
#: In a key's shape after a "-": two digits or more with a separator or a symbol (or
#: the key's end) on either side.
_ALONE_DIGITS = re.compile(r"[-!]0{2,}(?![0aA])")
_SEPARATED_DATE = re.compile(r"([0-9]{1,4})([-/\\_.])([0-9]{1,2})\2([0-9]{1,4})")
#: At least three zeros and the digits after them: a zero-padded counter.
_COUNTER = re.compile(r"0{3,}[0-9]*")


#: The fewest bits any reading of ``k`` digits standing alone costs, by ``k`` (a year or
#: a date at the least distance from the present, else the number), never below a
#: part's floor: what the quick bound charges them whatever the digits.
_DIGITS_LEAST = tuple(
    max(
        _MIN_MANY_BITS,
        min(
            k * _LOG2_10,
            math.log2(_MIN_YEAR_SPACE) if k == 4 else math.inf,
            math.log2(_MIN_YEAR_SPACE) + _LOG2_DAYS if k in _DATE_SPLITS else math.inf,
        ),
    )
    for k in range(64)
)


def _year_bits(year: int) -> float:
    return math.log2(max(abs(year - _REFERENCE_YEAR), _MIN_YEAR_SPACE))


def _day_month(a: int, b: int) -> bool:
    return (1 <= a <= 31 and 1 <= b <= 12) or (1 <= b <= 31 and 1 <= a <= 12)


def _date_year(x: int, y: int, z: int) -> int | None:
    """The year of day, month and year ``x y z`` in some order (zxcvbn's rules), or None."""
    if y > 31 or y <= 0:
        return None
    over_12 = over_31 = under_1 = 0
    for part in (x, y, z):
        if 99 < part < _DATE_MIN_YEAR or part > _DATE_MAX_YEAR:
            return None
        over_31 += part > 31
        over_12 += part > 12
        under_1 += part <= 0
    if over_31 >= 2 or over_12 == 3 or under_1 >= 2:
        return None
    for year, a, b in ((z, x, y), (x, y, z)):
        if _DATE_MIN_YEAR <= year <= _DATE_MAX_YEAR:
            return year if _day_month(a, b) else None
    for year, a, b in ((z, x, y), (x, y, z)):
        if _day_month(a, b):
            return year if year > 99 else year + (1900 if year > 50 else 2000)
    return None


def _date_bits(digits: str) -> float | None:
    """zxcvbn's guesses for 4 to 8 digits read as a date, in bits, or None."""
    best = None
    for k, m in _DATE_SPLITS[len(digits)]:
        year = _date_year(int(digits[:k]), int(digits[k:m]), int(digits[m:]))
        if year is not None:
            bits = _year_bits(year)
            best = bits if best is None else min(best, bits)
    return None if best is None else best + _LOG2_DAYS


# --- the estimate ---------------------------------------------------------------------


def guessing_bits(key: str) -> float:
    """log2 of the guesses ``key`` would take, readable parts counting for little."""
    full, free = _estimate(key)
    return max(0.0, min(full, READABLE_CAP_BITS + free))


def estimate_below(key: str, bits: float) -> float | None:
    """``guessing_bits(key)`` if that is below ``bits``, else None; cheap for most random
    keys (``_surely_at_least``)."""
    if _surely_at_least(key, bits):
        return None
    estimate = guessing_bits(key)
    return estimate if estimate < bits else None


def _surely_at_least(key: str, bits: float) -> bool:
    """True only if every cover of ``key`` costs ``bits`` or more: the key's brute force
    less the most any part a matcher could find would save is enough. False where it is
    not, or a rarer part (a self-repeat, a date with separators) is there: then the
    estimate decides. Searches run in ``str`` (faster than ``bytes`` in CPython)."""
    n = len(key)
    if n < 8 or not key.isascii():
        return False
    codes = key.encode("ascii")
    shape = codes.translate(_SHAPE_BYTES).decode("ascii")
    if "-0-" in shape or "-00-" in shape:
        return False
    if (key + key).find(key, 1) < n:
        return False
    alphabet = 26 * ("a" in shape) + 26 * ("A" in shape) + 10 * ("0" in shape)
    char_bits, most = _CHARACTER_BITS[alphabet]
    separators = shape.count("-")
    others = shape.count("!")
    brute_free = (n - separators - others) * char_bits + others * _SYMBOL_BITS
    # Enough even if parts saved this many bits:
    spare = brute_free - bits + min(separators * _SEPARATOR_BITS, READABLE_CAP_BITS)
    if spare < 0:
        return False
    number = int.from_bytes(codes, "little")
    covered = 0  # characters a readable part could cover, each saving ``most`` at most
    for shift, zeros in _REPEAT_MARKS:  # a part said twice in a row, first
        if zeros in ((number >> shift) ^ number).to_bytes(n, "little").decode("latin-1"):
            covered = _repeated(key, number, n)
            break
    if "000" in key:
        covered += sum(map(len, _COUNTER.findall(key)))
    # Words are three letters or more: in a key of one case, its shape shows them.
    if alphabet >= 26 and ("aaa" in shape or "AAA" in shape or alphabet >= 52):
        starts, words, longest = _WORD_STARTS, _WORDS, _LONGEST_WORD
        for run in _LETTER_RUN.findall(key.lower() if "A" in shape else key):
            end = len(run)
            reach = 0  # the end of the words counted so far
            for i in range(end - 2):
                if run[i : i + 3] in starts:
                    for j in range(min(end, i + longest), max(i + 2, reach), -1):
                        if run[i:j] in words:
                            covered += j - max(i, reach)
                            reach = j
                            break
        if covered * most > spare:
            return False
    # A run of k differences spans k + 1 characters.
    runs = _STEPS.findall(_differences(number, n))
    moves = _differences(int.from_bytes(codes.translate(_KEY_CODES), "little"), n)
    if "\x01\x01\x01" in moves.translate(_NEIGHBOURS).decode("latin-1"):
        runs += _WALK.findall(moves)
    if runs:
        covered += sum(map(len, runs)) + len(runs)
    saved = covered * most
    if alphabet in (10, 36, 62) and saved <= spare:
        least = _DIGITS_LEAST
        for run in _ALONE_DIGITS.findall("-" + shape):
            size = len(run) - 1  # after the separator or symbol that leads it
            saved += size * char_bits - (least[size] if size < len(least) else size * _LOG2_10)
    return saved <= spare


#: A part of a key: (end, start, bits saved against brute force, bits saved when
#: readable parts are free).
_Part = tuple[int, int, float, float]
#: Records a part: (start, end, log2 of its guesses, whether it is readable).
_Add = Callable[[int, int, float, bool], None]


def _estimate(key: str) -> tuple[float, float]:
    """(bits of the cheapest cover, bits of the cheapest cover with readable parts free)."""
    if not key.isascii():
        key = key.encode("ascii", "replace").decode("ascii")
    n = len(key)
    if n < 2:
        return n * _SYMBOL_BITS, n * _SYMBOL_BITS
    shape = key.translate(_SHAPE)
    alphabet = 26 * ("a" in shape) + 26 * ("A" in shape) + 10 * ("0" in shape)
    char_bits = _ALPHABET_BITS[alphabet] if alphabet else _SYMBOL_BITS
    separators = shape.count("-")
    others = shape.count("!")
    symbol_bits = others * _SYMBOL_BITS
    brute_free = (n - separators - others) * char_bits + symbol_bits
    brute_full = brute_free + separators * _SEPARATOR_BITS
    parts: list[_Part] = []

    def cost(start: int, end: int) -> tuple[float, float]:
        """Brute force for key[start:end]: (separators charged, separators free)."""
        if not (separators or others):
            return (bits := (end - start) * char_bits), bits
        piece = shape[start:end]
        seps = piece.count("-")
        other = piece.count("!")
        bits = (end - start - seps - other) * char_bits + other * _SYMBOL_BITS
        return bits + seps * _SEPARATOR_BITS, bits

    def add(start: int, end: int, bits: float, readable: bool) -> None:
        """key[start:end] is guessed in 2**bits."""
        full, free = cost(start, end)
        bits = max(bits, _MIN_MANY_BITS)
        save_free = free if readable else free - bits
        if save_free > 0 or full > bits:
            parts.append((end, start, full - bits, save_free))

    low = key.lower()
    if alphabet >= 26:  # letters (10 is digits alone)
        for run in _LETTER_RUN.finditer(low):
            letters_end = run.end()
            for i in range(run.start(), letters_end - 2):
                if low[i : i + 3] not in _WORD_STARTS:
                    continue
                for j in range(i + 3, min(letters_end, i + _LONGEST_WORD) + 1):
                    rank = _WORDS.get(low[i:j])
                    if rank:
                        case, readable = _case_bits(key[i:j])
                        add(i, j, math.log2(rank) + case, readable)

    codes = key.encode("ascii")
    number = int.from_bytes(codes, "little")
    steps = _differences(number, n)
    for step in _STEPS.finditer(steps):
        start, last = step.span()
        first = steps[start]
        if first == _SAME:
            add(start, last + 1, char_bits + math.log2(last + 1 - start), True)
            continue
        # A sequence that turns back ("...xyzyx...") shares its turning character with
        # the next one: each is also offered without its first character.
        token = key[start : last + 1]
        descending = first < _SAME
        add(start, last + 1, _sequence_bits(token, descending), True)
        if last - start >= 3:
            add(start + 1, last + 1, _sequence_bits(token[1:], descending), True)
    moves = _differences(int.from_bytes(codes.translate(_KEY_CODES), "little"), n)
    for walk in _WALK.finditer(moves):
        start, last = walk.span()
        turns = 1 + sum(map(ne, moves[start + 1 : last], moves[start : last - 1]))
        add(start, last + 1, _walk_bits(key[start : last + 1], turns), True)

    # The whole key as one part said again and again: its shortest period.
    period = (key + key).find(key, 1)
    if period < n and n % period == 0:
        _repeat(key, 0, period, n, parts, cost)
    for start, size, end in _short_repeats(key, number, n):
        _repeat(key, start, size, end, parts, cost)

    if alphabet in (10, 36, 62):
        _digit_parts(key, shape, add)

    if not parts:
        return brute_full, brute_free
    parts.sort()
    if all(map(le, map(itemgetter(0), parts), map(itemgetter(1), parts[1:]))):
        # No two parts overlap (the usual case): each one that saves is taken.
        return (
            brute_full - sum(max(part[2], 0.0) for part in parts),
            brute_free - sum(max(part[3], 0.0) for part in parts),
        )
    return brute_full - _best_saving(parts, 2), brute_free - _best_saving(parts, 3)


#: The estimates of short repeated parts ("==", "ab"), which recur from key to key. Only
#: of parts of four characters at most: a key is a secret, and no more of it than that
#: outlives its request here.
_estimate_short_part = lru_cache(maxsize=4_096)(_estimate)


def _short_repeats(key: str, number: int, n: int) -> list[tuple[int, int, int]]:
    """(start, size, end) for each part of 2 to 4 characters said again at once, and
    again while it lasts: ``abab``, ``abcabc``, ``a1b2a1b2``. Found where
    codes[i + size] == codes[i] for ``size`` positions in a row (``number``: the ``n``
    codes as one integer, as ``_differences`` takes them)."""
    found = []
    for size in (2, 3, 4):
        same = ((number >> (8 * size)) ^ number).to_bytes(n, "little")
        at = same.find(_ZEROS[size])
        while at >= 0:
            end = at + 2 * size
            while key.startswith(key[at : at + size], end):
                end += size
            found.append((at, size, end))
            at = same.find(_ZEROS[size], end - size + 1)
    return found


def _repeated(key: str, number: int, n: int) -> int:
    """How many characters the short repeats of ``key`` cover (a character in two of them
    counted twice: more is safe where this is used)."""
    return sum(end - start for start, _, end in _short_repeats(key, number, n))


def _repeat(
    key: str,
    start: int,
    size: int,
    end: int,
    parts: list[_Part],
    cost: Callable[[int, int], tuple[float, float]],
) -> None:
    """key[start:end] is key[start:start + size] said again and again: guessed as that
    base (estimated alone) times how often it is said, no more random than the base."""
    base = key[start : start + size]
    base_full, base_free = _estimate_short_part(base) if size <= 4 else _estimate(base)
    full, free = cost(start, end)
    bits = max(base_full + math.log2((end - start) // size), _MIN_MANY_BITS)
    if full > bits or free > base_free:
        parts.append((end, start, full - bits, free - base_free))


def _digit_parts(key: str, shape: str, add: _Add) -> None:
    """Digits standing alone between separators (or the key's ends): a date, a year, a
    number; zero-padded counters anywhere; dates with separators."""
    n = len(key)
    # "-" before the shape: every run standing alone follows a separator or a symbol.
    for run in _ALONE_DIGITS.finditer("-" + shape):
        start, end = run.start(), run.end() - 1
        size = end - start
        digits = key[start:end]
        if 4 <= size <= 8 and (bits := _date_bits(digits)) is not None:
            add(start, end, bits, False)
        if size == 4 and digits[:2] in ("19", "20"):
            add(start, end, _year_bits(int(digits)), False)
        add(start, end, size * _LOG2_10, False)
    if "000" in key:
        for counter in _COUNTER.finditer(key):
            start, end = counter.span()
            significant = len(counter.group().lstrip("0"))
            add(start, end, significant * _LOG2_10 + math.log2(end - start), True)
    if "-0-" in shape or "-00-" in shape:
        for date in _SEPARATED_DATE.finditer(key):
            start, end = date.span()
            if (start and shape[start - 1] == "0") or (end < n and shape[end] == "0"):
                continue
            year = _date_year(int(date.group(1)), int(date.group(3)), int(date.group(4)))
            if year is not None:
                add(start, end, _year_bits(year) + _LOG2_DAYS + 2, False)


def _best_saving(parts: list[_Part], field: int) -> float:
    """The largest total saving of parts that do not overlap (weighted interval
    scheduling): parts by end, each added to the best that ends at or before its start."""
    ends = [0]
    best = [0.0]
    for part in parts:
        end, start = part[0], part[1]
        candidate = best[bisect_right(ends, start) - 1] + part[field]
        if candidate > best[-1]:
            if ends[-1] == end:
                best[-1] = candidate
            else:
                ends.append(end)
                best.append(candidate)
    return best[-1]

"""The key guard's estimator: readable keys are refused, random ones pass.

A key without a namespace needs an estimated guessing entropy of 100 bits (SPEC.md,
"Values"). Random keys are generated from seeded generators, so that a failure names a
key that can be made again.
"""

from __future__ import annotations

import base64
import random
import string
import uuid
from collections.abc import Callable, Iterator
from importlib.resources import files

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from leasekeeper import InvalidRequest
from leasekeeper._core import validation
from leasekeeper._core.keyguess import READABLE_CAP_BITS, estimate_below, guessing_bits

ENOUGH = validation.MIN_BARE_KEY_BITS
WORDS = (
    (files("leasekeeper._core").joinpath("keyguess_words.txt").read_text("ascii"))
    .partition("\n\n")[2]
    .split()
)
SEPARATORS = "-_.:/\\|@#=+,;~"

READABLE = [
    # the and SPEC.md's examples
    "invoice:2026-09-05:customer=john.doe@example.com",
    "the-quick-brown-fox-jumps-over-the-lazy-dog",
    "ab" * 100,
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789",
    "order-0000000000000000000000000001",
    "a" * 40,
    "0" * 39 + "1",
    # phrases and names
    "thequickbrownfoxjumpsoverthelazydog",
    "TheQuickBrownFoxJumpsOverTheLazyDog",
    "nightly_report_for_customer_account_payments",
    "InvoiceCustomerJohnSmithPayment2026",
    "mary.jane.watson.peter.parker.new.york.city",
    "webhook-event-user-account-order-payment-invoice-report-job",
    "JAMES-ROBERT-MICHAEL-WILLIAM-DAVID-RICHARD",
    # dates and numbers
    "invoice-20260905-customer-48213977-nightly",
    "report/2026-09-05/2026-09-06/2026-09-07/run",
    "nightly-report-1788602460999-customer-john",
    "user-48213977-order-99123456-2026-09-05",
    # e-mail addresses and domains
    "john.doe@example.com:jane.roe@example.org",
    "billing+invoice@mail.example.com/webhook",
    "https://www.example.com/webhook/events/payment",
    # keyboard walks, repeats, sequences
    "qwertyuiopasdfghjklzxcvbnm1234567890",
    "1qaz2wsx3edc4rfv5tgb6yhn7ujm8ik9ol0p",
    "asdfasdfasdfasdfasdfasdfasdfasdfasdf",
    "zxcvbnm,./zxcvbnm,./zxcvbnm,./zxcvbnm",
    "abcdefghijklmnopqrstuvwxyzyxwvutsrqponmlkjihgfedcba",
    "0123456789876543210123456789876543210",
    "a1b2a1b2a1b2a1b2a1b2a1b2a1b2a1b2a1b2",
    "xyzxyzxyzxyzxyzxyzxyzxyzxyzxyzxyzxyz",
    "9876543210987654321098765432109876543210",
    # counters with a prefix
    "job-00000000000000000000000000000042",
    "order_000000000000000000000000000123456",
    "customer-000000000000000000000000000000000000000000000007",
]


@pytest.mark.parametrize("key", READABLE)
def test_readable_keys_are_refused(key: str) -> None:
    """Words, names, dates, e-mail addresses, keyboard walks, repeats, sequences and
    counters count for little: each of these keys is estimated under 100 bits."""
    assert guessing_bits(key) < ENOUGH
    with pytest.raises(InvalidRequest):
        validation.check_bare_key(key)


def _base58(data: bytes, width: int) -> str:
    alphabet = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
    number = int.from_bytes(data, "big")
    digits = []
    while number:
        number, digit = divmod(number, 58)
        digits.append(alphabet[digit])
    return "".join(reversed(digits)).rjust(width, "1")


def _kinds(rng: random.Random) -> dict[str, Callable[[int], str]]:
    """Each kind of random key, as made by its usual call, from ``rng``'s bytes; the
    argument is the key's index, which picks the length where a kind has several."""
    return {
        "uuid4": lambda i: str(uuid.UUID(bytes=rng.randbytes(16), version=4)),
        # secrets.token_urlsafe(n) for n from 24 to 64
        "token_urlsafe": lambda i: (
            base64.urlsafe_b64encode(rng.randbytes(24 + i % 41)).rstrip(b"=").decode()
        ),
        # secrets.token_hex(n) for n from 16 to 64
        "token_hex": lambda i: rng.randbytes(16 + i % 49).hex(),
        # 128 bits in base32, 32 characters with its padding
        "base32": lambda i: base64.b32encode(rng.randbytes(16)).decode(),
        # base58 has no padding: 16 bytes are 22 characters, too short for a key without a
        # namespace (32 at least), so 24 bytes (192 bits), written at their full width of
        # 33 characters (base58's zero is "1").
        "base58": lambda i: _base58(rng.randbytes(24), 33),
    }


@pytest.mark.parametrize("kind", ["uuid4", "token_urlsafe", "token_hex", "base32", "base58"])
def test_ten_thousand_random_keys_of_each_kind_pass(kind: str) -> None:
    """Keys made by uuid4, token_urlsafe(24..64), token_hex(16..64), base32 of 128 bits
    and base58 of 192 bits are accepted: 10,000 of each, from a fixed seed."""
    make = _kinds(random.Random(f"leasekeeper-{kind}"))[kind]
    refused = []
    for i in range(10_000):
        key = make(i)
        if guessing_bits(key) < ENOUGH:
            refused.append(key)
    assert refused == []


def test_the_lowest_estimates_of_random_keys_leave_room() -> None:
    """The lowest estimate among 2,000 keys of each kind is well above 100 bits, so the
    10,000-key test above is no lucky draw."""
    for kind, make in _kinds(random.Random("leasekeeper-margin")).items():
        lowest = min(guessing_bits(make(i)) for i in range(2_000))
        assert lowest >= ENOUGH + 5, kind


@st.composite
def phrases(draw: st.DrawFn) -> str:
    """Words of the list, written lower, upper or capitalised, joined by one separator
    (or none), 32 to 200 characters in all."""
    words = draw(st.lists(st.sampled_from(WORDS), min_size=1, max_size=60))
    cases = draw(st.lists(st.sampled_from([str.lower, str.upper, str.capitalize]), min_size=1))
    separator = draw(st.sampled_from(["", *SEPARATORS]))
    kept: list[str] = []
    for i, word in enumerate(words):
        if len(separator.join([*kept, word])) > 200:
            break
        kept.append(cases[i % len(cases)](word))
    key = separator.join(kept)
    assume(len(key) >= 32)
    return key


@settings(max_examples=150, deadline=None)
@given(phrases())
def test_a_key_made_of_listed_words_never_passes(key: str) -> None:
    """However many words and whichever separator: readable parts add at most
    READABLE_CAP_BITS, well under 100."""
    assert guessing_bits(key) <= READABLE_CAP_BITS + 1e-9 < ENOUGH


def _words_joined(rng: random.Random) -> Iterator[str]:
    while True:
        words = [rng.choice(WORDS) for _ in range(rng.randint(2, 40))]
        key = rng.choice(["", *SEPARATORS]).join(words)
        if 32 <= len(key) <= 200:
            yield key


def test_the_longest_phrases_stay_under_the_cap() -> None:
    """Up to 200 characters of words, 500 of them drawn at random, none estimated above
    the cap."""
    keys = _words_joined(random.Random("leasekeeper-phrases"))
    assert max(guessing_bits(next(keys)) for _ in range(500)) <= READABLE_CAP_BITS + 1e-9


def test_a_readable_prefix_costs_a_random_key_nothing() -> None:
    """invoice- before a uuid4 is still a random key; before 8 random bytes it is not."""
    rng = random.Random("leasekeeper-prefix")
    assert guessing_bits("invoice-" + str(uuid.UUID(bytes=rng.randbytes(16), version=4))) > 120
    assert guessing_bits("invoice-" + rng.randbytes(8).hex()) < ENOUGH


def test_the_refusal_names_the_estimate_and_how_to_make_a_good_key() -> None:
    """The message gives the estimate rounded down to a tenth, what counts for little and
    how to make a good key, and never the key."""
    key = "invoice:2026-09-05:customer=john.doe@example.com"
    with pytest.raises(InvalidRequest) as refused:
        validation.check_bare_key(key)
    message = refused.value.error
    shown = int(guessing_bits(key) * 10) / 10
    assert f"this one is estimated at {shown:.1f} bits)" in message
    assert "at least 100 bits of entropy, where words, names, dates" in message
    assert "uuid.uuid4()" in message and "secrets.token_urlsafe(32)" in message
    assert "mint a namespace" in message
    assert key not in message and "john" not in message


def test_the_estimate_is_a_pure_function_of_the_key() -> None:
    """The same key, the same estimate; any string is estimated, even one that is no
    valid key."""
    key = str(uuid.UUID(bytes=bytes(range(16)), version=4))
    assert guessing_bits(key) == guessing_bits(key)
    assert guessing_bits("") == 0.0
    assert guessing_bits("é" * 40) < ENOUGH
    assert guessing_bits("x") < 10
    assert guessing_bits(string.printable * 2) < ENOUGH


def test_the_word_list_is_lowercase_words_of_three_letters_or_more() -> None:
    """The matcher reads lowercase ASCII letters; its file names its sources and licence."""
    assert all(len(word) >= 3 and word.isalpha() and word.islower() for word in WORDS)
    assert WORDS[:3] == ["key", "job", "task"]
    header = files("leasekeeper._core").joinpath("keyguess_words.txt").read_text("ascii")
    assert "zxcvbn" in header.partition("\n\n")[0] and "MIT" in header.partition("\n\n")[0]


def _keys_to_compare() -> list[str]:
    rng = random.Random("leasekeeper-agree")
    keys = [make(i) for make in _kinds(rng).values() for i in range(1_000)]
    keys += READABLE
    for prefix in ("invoice-", "job_", "2026-09-05-", "order:0000", ""):
        keys += [prefix + rng.randbytes(rng.randint(4, 24)).hex() for _ in range(200)]
    return keys


def test_the_quick_answer_is_the_estimates_answer() -> None:
    """estimate_below gives the estimate when it is below the bar and None when it is
    not, exactly as comparing guessing_bits would: over random keys of each kind, the
    readable keys above, and readable prefixes before random parts of every length."""
    for key in _keys_to_compare():
        estimate = guessing_bits(key)
        for bits in (60.0, ENOUGH, 140.0):
            assert estimate_below(key, bits) == (estimate if estimate < bits else None), key


@settings(max_examples=400, deadline=None)
@given(
    st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=200),
    st.sampled_from([40.0, ENOUGH, 160.0]),
)
def test_the_quick_answer_agrees_on_any_printable_text(key: str, bits: float) -> None:
    """Whatever the text, the quick answer and the estimate agree."""
    estimate = guessing_bits(key)
    assert estimate_below(key, bits) == (estimate if estimate < bits else None)

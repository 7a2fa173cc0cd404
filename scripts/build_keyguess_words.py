"""Write src/leasekeeper/_core/keyguess_words.txt, the word list of the key-entropy guard.

Run with the ``zxcvbn`` package (4.5.0, MIT licence, Copyright (c) 2016 Daniel Wolf;
frequency lists from Dropbox's zxcvbn, Copyright (c) 2012-2016 Dan Wheeler and Dropbox,
Inc., MIT licence) importable, from the repository's root::

    python -m venv /tmp/zx && /tmp/zx/bin/pip install zxcvbn==4.5.0
    /tmp/zx/bin/python scripts/build_keyguess_words.py

The output is one word a line, most common first: the words that job and business keys
are made of (below), then the most common entries of zxcvbn's English (Wikipedia, US TV
and film), first-name and surname lists, interleaved by rank. Only lowercase ASCII
letters, three or more.
"""

from __future__ import annotations

import re
from pathlib import Path

from zxcvbn.frequency_lists import FREQUENCY_LISTS

OUT = (
    Path(__file__).resolve().parent.parent / "src" / "leasekeeper" / "_core" / "keyguess_words.txt"
)

#: How many entries of each zxcvbn list are kept (each list is most common first).
TAKE = {
    "english_wikipedia": 12_000,
    "us_tv_and_film": 8_000,
    "surnames": 4_000,
    "female_names": 1_500,
    "male_names": 983,
}

#: Words of job, business and web keys, placeholder names, mail hosts and domain endings:
#: first in the list, so they count as the most common words.
KEY_WORDS = """
    key job task run user order invoice customer payment account report event
    webhook nightly daily weekly monthly hourly yearly batch import export sync backup
    lease lock tenant org team project build deploy release prod production staging dev
    test api request response session cart checkout subscription renewal charge refund
    payout transfer transaction txn ledger settlement billing bill receipt shipment
    delivery email mail message msg notify notification queue worker cron schedule
    cleanup purge retry migration upload download file document doc image video item
    product sku stock inventory price quote contract client vendor supplier partner
    member admin owner group role device service server node cluster region zone
    pipeline stage step workflow flow callback hook trigger handler consumer producer
    topic stream partition offset snapshot checkpoint version revision commit branch
    ticket issue case incident alert alarm metric log audit trace span record entry
    row table db database cache index search query count total sum summary digest
    newsletter campaign signup login logout register password reset verify confirm
    onboarding welcome reminder invite subscriber follower post comment like share
    new old tmp temp default main primary secondary first last next prev previous
    doe roe smith jane john foo bar baz qux example sample demo dummy fake mock
    gmail yahoo hotmail outlook icloud proton aol msn live
    com org net dev app info biz edu gov www http https
""".split()  # noqa: SIM905 (a paragraph of words reads better than a list)


HEADER = """\
# The word list of leasekeeper's key guard (src/leasekeeper/_core/keyguess.py): one word a
# line, most common first. Written by scripts/build_keyguess_words.py; do not edit by hand.
#
# Besides the words of job and business keys listed in that script, the words are the most
# common entries of the frequency lists of zxcvbn (English Wikipedia, US television and
# film, first names, surnames), as packaged in the Python zxcvbn 4.5.0:
#   Copyright (c) 2012-2016 Dan Wheeler and Dropbox, Inc. (zxcvbn); MIT licence.
#   Copyright (c) 2016 Daniel Wolf (the Python port); MIT licence.
# Permission is hereby granted, free of charge, to any person obtaining a copy of this
# software and associated documentation files (the "Software"), to deal in the Software
# without restriction, including without limitation the rights to use, copy, modify,
# merge, publish, distribute, sublicense, and/or sell copies of the Software, and to permit
# persons to whom the Software is furnished to do so, subject to the following conditions:
# The above copyright notice and this permission notice shall be included in all copies or
# substantial portions of the Software.
# THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR IMPLIED,
# INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY, FITNESS FOR A PARTICULAR
# PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE AUTHORS OR COPYRIGHT HOLDERS BE LIABLE
# FOR ANY CLAIM, DAMAGES OR OTHER LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR
# OTHERWISE, ARISING FROM, OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER
# DEALINGS IN THE SOFTWARE.
"""


def main() -> None:
    letters = re.compile(r"[a-z]{3,}\Z")
    words: list[str] = []
    seen: set[str] = set()
    for word in KEY_WORDS:
        if letters.match(word) and word not in seen:
            seen.add(word)
            words.append(word)
    ranked = []
    for order, (name, count) in enumerate(TAKE.items()):
        kept = [w for w in FREQUENCY_LISTS[name] if letters.match(w)][:count]
        ranked += [(rank, order, word) for rank, word in enumerate(kept)]
    for _, _, word in sorted(ranked):
        if word not in seen:
            seen.add(word)
            words.append(word)
    OUT.write_text(HEADER + "\n" + "".join(f"{word}\n" for word in words))
    print(f"{OUT}: {len(words)} words")


if __name__ == "__main__":
    main()

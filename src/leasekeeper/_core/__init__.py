"""The pure core: lease records, rules, secrets and input checks. No I/O, no clock reads."""

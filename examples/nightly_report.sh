#!/bin/sh
# The nightly job that cron starts on every machine; `leasekeeper run` (see the crontab
# line in docs/recipes/scheduled-jobs.md) lets one of them run it. Its writes carry the
# lease's fencing token, so a run that lost its lease cannot overwrite a newer one's.
set -eu
echo "report for $(date +%F) by $(hostname), fencing token ${LEASEKEEPER_FENCING_TOKEN}"
sleep 1

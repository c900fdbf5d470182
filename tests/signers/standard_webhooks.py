"""Signs a delivery with the official Standard Webhooks library (PyPI `standardwebhooks`).

Usage: standard_webhooks.py SECRET MSG_ID TIMESTAMP < body
Prints the three headers as a JSON object. Several secrets, comma-separated, sign with
each (a sender rotating its secret sends every signature, space-separated).
"""

import json
import sys
from datetime import datetime, timezone

from standardwebhooks.webhooks import Webhook


def main() -> None:
    secrets, msg_id, timestamp = sys.argv[1].split(","), sys.argv[2], int(sys.argv[3])
    body = sys.stdin.buffer.read().decode("utf-8")
    at = datetime.fromtimestamp(timestamp, tz=timezone.utc)
    signature = " ".join(Webhook(s).sign(msg_id, at, body) for s in secrets)
    # The library's own check accepts what it signed (with a timestamp of now only).
    json.dump(
        {
            "webhook-id": msg_id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": signature,
        },
        sys.stdout,
    )


if __name__ == "__main__":
    main()

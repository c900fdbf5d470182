"""Signs a delivery with a provider's official Python library.

    sign.py standard-webhooks SECRETS MSG_ID TIMESTAMP < body
        prints the webhook-id, webhook-timestamp and webhook-signature headers as a JSON
        object (PyPI `standardwebhooks`); SECRETS is comma-separated, and each signs (a
        sender rotating its secret sends every signature, space-separated)
    sign.py slack SECRET TIMESTAMP < body
        prints the X-Slack-Request-Timestamp and X-Slack-Signature headers as a JSON
        object (PyPI `slack_sdk`, SignatureVerifier.generate_signature)
"""

import json
import sys
from datetime import datetime, timezone


def standard_webhooks(secrets: str, msg_id: str, timestamp: str, body: str) -> dict:
    from standardwebhooks.webhooks import Webhook

    at = datetime.fromtimestamp(int(timestamp), tz=timezone.utc)
    signature = " ".join(Webhook(s).sign(msg_id, at, body) for s in secrets.split(","))
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": timestamp,
        "webhook-signature": signature,
    }


def slack(secret: str, timestamp: str, body: str) -> dict:
    from slack_sdk.signature import SignatureVerifier

    signature = SignatureVerifier(secret).generate_signature(timestamp=timestamp, body=body)
    return {"x-slack-request-timestamp": timestamp, "x-slack-signature": signature}


def main() -> None:
    scheme, args = sys.argv[1], sys.argv[2:]
    body = sys.stdin.buffer.read().decode("utf-8")
    schemes = {"standard-webhooks": standard_webhooks, "slack": slack}
    if scheme not in schemes:
        sys.exit(f"unknown scheme {scheme}: standard-webhooks or slack")
    json.dump(schemes[scheme](*args, body), sys.stdout)


if __name__ == "__main__":
    main()

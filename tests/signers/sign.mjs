// Signs a delivery with a provider's official Node library.
//
//   node sign.mjs stripe SECRET TIMESTAMP < body   prints a Stripe-Signature value
//                                                   (stripe.webhooks.generateTestHeaderString)
//   node sign.mjs github SECRET < body              prints an X-Hub-Signature-256 value
//                                                   (@octokit/webhooks-methods sign)
import { sign as githubSign } from "@octokit/webhooks-methods";
import Stripe from "stripe";

const [scheme, secret, timestamp] = process.argv.slice(2);
const chunks = [];
for await (const chunk of process.stdin) chunks.push(chunk);
const payload = Buffer.concat(chunks).toString("utf8");

if (scheme === "stripe") {
  const stripe = new Stripe("sk_test_unused");
  process.stdout.write(
    stripe.webhooks.generateTestHeaderString({ payload, secret, timestamp: Number(timestamp) }),
  );
} else if (scheme === "github") {
  process.stdout.write(await githubSign(secret, payload));
} else {
  console.error(`unknown scheme ${scheme}: stripe or github`);
  process.exit(2);
}

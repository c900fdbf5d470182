// Signs a delivery with a provider's official Node library.
//
//   node sign.mjs stripe SECRET TIMESTAMP < body   prints a Stripe-Signature value
//                                                   (stripe.webhooks.generateTestHeaderString)
//   node sign.mjs github SECRET < body              prints an X-Hub-Signature-256 value
//                                                   (@octokit/webhooks-methods sign)
//   node sign.mjs shopify SECRET < body             prints an X-Shopify-Hmac-SHA256 value
//                                                   (@shopify/shopify-api createSHA256HMAC,
//                                                   what its webhook validation computes)
import { sign as githubSign } from "@octokit/webhooks-methods";
import { createSHA256HMAC } from "@shopify/shopify-api/runtime";
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
} else if (scheme === "shopify") {
  process.stdout.write(await createSHA256HMAC(secret, payload));
} else {
  console.error(`unknown scheme ${scheme}: stripe, github or shopify`);
  process.exit(2);
}

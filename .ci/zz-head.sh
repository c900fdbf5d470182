#!/usr/bin/env bash
# CI entry point: brings up PostgreSQL on this machine if needed, then runs the
# README's test command. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

# Each step's start, with the seconds since this script began: a run that fails or runs
# long says where its time went.
log() { printf '==> [%4ds] %s\n' "$SECONDS" "$*"; }

# A clean clone builds everything once: incremental compilation's caches would only be
# written, never read (they cost the first build time and disk).
export CARGO_INCREMENTAL=0

# The build and the test binaries take a few GB (Cargo.toml keeps line tables only); a
# disk that fills up mid-run fails a link with "Bus error", far from its cause.
log "free disk here: $(df -h . | awk 'NR == 2 { print $4 }')"

# 0. Formatting, and the dependency tree's licenses, bans and sources (deny.toml;
#    advisories need a network CI does not have): quick, so before anything is built.
log "cargo fmt --all -- --check"
cargo fmt --all -- --check
if ! cargo deny --version >/dev/null 2>&1; then
  log "cargo-deny is missing: installing it from crates.io"
  cargo install cargo-deny --locked
fi
log "cargo deny check licenses bans sources"
cargo deny check licenses bans sources

# 1. PostgreSQL installed?
if ! command -v pg_ctlcluster >/dev/null 2>&1 || ! ls /etc/postgresql/*/main >/dev/null 2>&1; then
  log "PostgreSQL is missing: installing it with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q postgresql postgresql-client
fi

# 2. PostgreSQL answering?
if ! pg_isready -h 127.0.0.1 -p 5432 -q; then
  version=$(ls /etc/postgresql | sort -V | tail -n 1)
  log "PostgreSQL $version is not answering: starting it"
  pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
  for _ in $(seq 1 60); do
    pg_isready -h 127.0.0.1 -p 5432 -q && break
    sleep 0.5
  done
  pg_isready -h 127.0.0.1 -p 5432
fi

# 3. Where the tests find it.
export DATABASE_URL="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}"

# A freshly installed cluster asks for passwords on TCP; the tests expect trust auth on
# loopback, as the development machines have it.
if ! psql "$DATABASE_URL" -Atqc 'SELECT 1' >/dev/null 2>&1; then
  version=$(ls /etc/postgresql | sort -V | tail -n 1)
  hba="/etc/postgresql/$version/main/pg_hba.conf"
  log "cannot connect as in DATABASE_URL: allowing trust auth on loopback in $hba"
  sed -i '1i host all all 127.0.0.1/32 trust\nhost all all ::1/128 trust' "$hba"
  pg_ctlcluster --skip-systemctl-redirect "$version" main reload
  sleep 1
  psql "$DATABASE_URL" -Atqc 'SELECT 1' >/dev/null
fi
log "PostgreSQL answers at $DATABASE_URL"

# 4. PgBouncer, for tests/tests/pooler.rs: each of its tests starts a PgBouncer of its
#    own in transaction mode in front of its test database. Debian installs it in
#    /usr/sbin, outside a non-root PATH.
if ! command -v pgbouncer >/dev/null 2>&1 && [ ! -x /usr/sbin/pgbouncer ]; then
  log "PgBouncer is missing: installing it with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q pgbouncer
fi

# 4b. Citus, for tests/tests/citus.rs: each of its tests starts a throwaway cluster of
#     its own (a coordinator and two workers, initdb on free ports) from this machine's
#     PostgreSQL, which needs the extension installed. Citus is in no package registry:
#     it is built from the vendored source (CITUS_ARCHIVE, default
#     ../shared/vendor/citus-13.0.5.tar.gz beside this checkout) and installed with
#     `make install`. IDEM_REQUIRE_CITUS=1 makes those tests fail instead of skipping.
export IDEM_REQUIRE_CITUS=1
if [ ! -f "$(pg_config --pkglibdir 2>/dev/null)/citus.so" ] ||
   [ ! -f "$(pg_config --sharedir 2>/dev/null)/extension/citus.control" ]; then
  archive="${CITUS_ARCHIVE:-../shared/vendor/citus-13.0.5.tar.gz}"
  if [ ! -f "$archive" ]; then
    echo "Citus is not installed and its source is not at $archive: set CITUS_ARCHIVE" >&2
    exit 1
  fi
  log "Citus is missing: building it from $archive"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  major=$(ls /usr/lib/postgresql | sort -V | tail -n 1)
  apt-get install -y -q "postgresql-server-dev-$major" liblz4-dev libzstd-dev libkrb5-dev \
    libssl-dev libxml2-dev libxslt1-dev libreadline-dev libselinux1-dev libpam0g-dev \
    zlib1g-dev make gcc flex bison
  build=$(mktemp -d)
  tar -xzf "$archive" -C "$build"
  (cd "$build"/citus-* && ./configure --without-libcurl >/dev/null &&
     make -j"$(nproc)" >/dev/null && make install >/dev/null)
  rm -rf "$build"
fi

# 4c. The outbox's brokers (tests/tests/outbox_*.rs): NATS with JetStream on 4222 and
#     RabbitMQ on 5672 (guest/guest). Each test uses streams, subjects, queues of its
#     own; the tests that stop a broker start a private nats-server of their own.
answers() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
if ! command -v nats-server >/dev/null 2>&1 && [ ! -x /usr/sbin/nats-server ]; then
  log "nats-server is missing: installing it with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q nats-server
fi
if ! answers 4222; then
  log "nats-server is not answering on 4222: starting it with JetStream"
  nats=$(command -v nats-server || echo /usr/sbin/nats-server)
  mkdir -p /var/tmp/idem-nats
  nohup "$nats" -js -a 127.0.0.1 -p 4222 -sd /var/tmp/idem-nats >/var/tmp/idem-nats.log 2>&1 &
  for _ in $(seq 1 60); do answers 4222 && break; sleep 0.5; done
  answers 4222
fi
if ! command -v rabbitmqctl >/dev/null 2>&1 && [ ! -x /usr/sbin/rabbitmqctl ]; then
  log "rabbitmq-server is missing: installing it with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q rabbitmq-server
fi
if ! answers 5672; then
  log "RabbitMQ is not answering on 5672: starting it"
  PATH="$PATH:/usr/sbin" rabbitmq-server -detached || true
  for _ in $(seq 1 120); do answers 5672 && break; sleep 0.5; done
  answers 5672
fi
log "NATS (JetStream) answers on 4222, RabbitMQ on 5672"

# 4d. The outside tools the tests check against (tests/tools: the webhook providers'
#    official signing libraries from PyPI and npm, and schemathesis from PyPI), under
#    target/test-tools. The tests install them themselves when missing; doing it here
#    first makes a registry failure read as one.
log "tests/tools/install"
tests/tools/install

# 4e. Headless Chromium and its WebDriver, for tests/tests/console.rs: an operator drives
#     the example's console in a real browser (fantoccini talks to chromedriver).
if ! command -v chromedriver >/dev/null 2>&1 || ! command -v chromium >/dev/null 2>&1; then
  log "chromium or chromedriver is missing: installing them with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q chromium chromium-driver
fi

# 5. The README's test command, then the lint gate (it also proves that generated code
#    fires no clippy lint, pedantic included: tests/tests/pedantic.rs).

/* A small closed-loop load client for bench/proxy_overhead.sh.
 *
 *   http_load PORT CONCURRENCY COUNT BODY_FILE [THREADS]
 *   http_load unix:SOCKET CONCURRENCY COUNT FIELDS_FILE
 *
 * Opens CONCURRENCY keep-alive connections to 127.0.0.1:PORT (TCP_NODELAY)
 * and sends COUNT requests `POST /v1/completions` with the body from
 * BODY_FILE, one at a time per connection, from THREADS threads (default 1),
 * each a poll loop over its share of the connections and the requests. A
 * request's time runs from its send to the last byte of its answer; nothing
 * else happens inside it. One thread handles the answers that come together
 * one after another, and the last one's time holds the others' reads and
 * sends (about 6 us each): more threads take that out of the figures.
 * Prints one line per answer:
 *   LATENCY_MS PROMPT_MS PREDICTED_MS
 * (the last two from the answer's "timings"); with HTTP_LOAD_TRACE=1 three
 * more: the send and the answer's end (CLOCK_MONOTONIC ns) and the
 * connection's local port, for bench/trace_report.py to find the request in
 * the proxy's DS4_TRACE records. Written in C so that the
 * client's own cost, which the bench charges to ds4, stays in microseconds.
 *
 * With unix:SOCKET it is the engine alone: it speaks the worker protocol
 * (shared/protocol.h) on one connection to a worker's socket, as the proxy
 * does, keeping CONCURRENCY generate requests in flight, each
 *   {"op":"generate","id":N,<FIELDS_FILE's text, without its leading "{">
 * and a request's time runs from its send to its "done" line. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

enum { MAX_CONN = 1024, BUF = 1 << 16 };

struct conn {
  int fd;
  char buf[BUF];
  size_t len;
  double t0;
  int port;  /* local */
};

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void die(const char *what) {
  perror(what);
  exit(1);
}

/* Length of the whole response in c->buf once it is complete, else 0. */
static size_t complete(const struct conn *c) {
  const char *end = memmem(c->buf, c->len, "\r\n\r\n", 4);
  if (!end) return 0;
  size_t head = (size_t)(end - c->buf) + 4, body = 0;
  for (const char *p = c->buf; p < end; p++) {
    if ((p == c->buf || p[-1] == '\n') && strncasecmp(p, "content-length:", 15) == 0) body = strtoul(p + 15, NULL, 10);
  }
  return c->len >= head + body ? head + body : 0;
}

static double timing(const char *body, size_t n, const char *key) {
  const char *p = memmem(body, n, key, strlen(key));
  return p ? strtod(p + strlen(key), NULL) : -1;
}

/* HTTP_LOAD_TRACE=1: per answer, send and end (ns) and the local port. */
static double *traced;

static void print(const double *out, int count) {
  for (int i = 0; i < count; i++) {
    printf("%.4f %.4f %.4f", out[3 * i], out[3 * i + 1], out[3 * i + 2]);
    if (traced) printf(" %.0f %.0f %.0f", traced[3 * i], traced[3 * i + 1], traced[3 * i + 2]);
    printf("\n");
  }
}

/* The engine alone: generate requests with ids on one worker connection. */
static int worker_load(const char *path, int conc, int count, const char *fields, size_t fields_len) {
  if (fields_len < 2 || fields[0] != '{') {
    fprintf(stderr, "http_load: the fields file must hold a JSON object\n");
    return 2;
  }
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  if (strlen(path) >= sizeof addr.sun_path) {
    fprintf(stderr, "http_load: socket path too long\n");
    return 2;
  }
  strcpy(addr.sun_path, path);
  const int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  if (fd < 0) die("socket");
  if (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) die("connect");
  double *t0 = calloc((size_t)count + 1, sizeof(double)), *out = malloc(sizeof(double) * 3 * (size_t)count);
  static char buf[BUF], line[BUF + 64];
  if (!t0 || !out) die("malloc");
  size_t len = 0;
  int sent = 0, done = 0;
  while (done < count) {
    while (sent < count && sent - done < conc) {
      sent++;  /* ids run from 1 */
      const int n = snprintf(line, sizeof line, "{\"op\":\"generate\",\"id\":%d,%.*s\n", sent,
                             (int)(fields_len - 1), fields + 1);
      t0[sent] = now_ms();
      if (write(fd, line, (size_t)n) != n) die("write");
    }
    const ssize_t n = read(fd, buf + len, sizeof buf - len);
    if (n <= 0) {
      fprintf(stderr, "http_load: the worker closed the connection\n");
      return 1;
    }
    len += (size_t)n;
    char *start = buf, *nl;
    while ((nl = memchr(start, '\n', len - (size_t)(start - buf)))) {
      const size_t ln = (size_t)(nl - start);
      if (memmem(start, ln, "\"ev\":\"error\"", 12)) {
        fprintf(stderr, "http_load: the worker answered %.*s\n", (int)ln, start);
        return 1;
      }
      const char *id = memmem(start, ln, "\"id\":", 5);
      if (memmem(start, ln, "\"ev\":\"done\"", 11) && id) {
        const long i = strtol(id + 5, NULL, 10);
        if (i < 1 || i > sent) {
          fprintf(stderr, "http_load: an answer for unknown id %ld\n", i);
          return 1;
        }
        out[3 * done] = now_ms() - t0[i];
        out[3 * done + 1] = timing(start, ln, "\"prompt_ms\":");
        out[3 * done + 2] = timing(start, ln, "\"predicted_ms\":");
        done++;
      }
      start = nl + 1;
    }
    len -= (size_t)(start - buf);
    memmove(buf, start, len);
  }
  print(out, count);
  return 0;
}

/* One thread's share: connections [first, first + conc), `count` requests. */
struct share {
  int port, first, conc, count;
  const char *req;
  int req_len;
  double *out;  /* 3 per answer */
  double *traced;  /* 3 per answer, or NULL */
  int failed;
};

static struct conn conns[MAX_CONN];

static void *http_share(void *arg) {
  struct share *s = arg;
  struct pollfd pfd[MAX_CONN];
  struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((unsigned short)s->port)};
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  int sent = 0, done = 0;
  for (int i = 0; i < s->conc; i++) {
    struct conn *c = &conns[s->first + i];
    c->fd = socket(AF_INET, SOCK_STREAM, 0);
    if (c->fd < 0) die("socket");
    const int one = 1;
    setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (connect(c->fd, (struct sockaddr *)&addr, sizeof addr) != 0) die("connect");
    struct sockaddr_in local;
    socklen_t local_len = sizeof local;
    if (getsockname(c->fd, (struct sockaddr *)&local, &local_len) != 0) die("getsockname");
    c->port = ntohs(local.sin_port);
    pfd[i].fd = c->fd;
    pfd[i].events = POLLIN;
  }
  for (int i = 0; i < s->conc && sent < s->count; i++, sent++) {
    struct conn *c = &conns[s->first + i];
    c->t0 = now_ms();
    if (write(c->fd, s->req, (size_t)s->req_len) != s->req_len) die("write");
  }
  while (done < s->count) {
    if (poll(pfd, (nfds_t)s->conc, -1) < 0) die("poll");
    for (int i = 0; i < s->conc; i++) {
      if (!(pfd[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      struct conn *c = &conns[s->first + i];
      const ssize_t n = read(c->fd, c->buf + c->len, sizeof c->buf - c->len);
      if (n <= 0) {
        fprintf(stderr, "http_load: the server closed a connection\n");
        s->failed = 1;
        return NULL;
      }
      c->len += (size_t)n;
      const size_t whole = complete(c);
      if (!whole) continue;
      const double t = now_ms() - c->t0;
      const char *b = memmem(c->buf, whole, "\r\n\r\n", 4) + 4;
      const size_t bn = whole - (size_t)(b - c->buf);
      s->out[3 * done] = t;
      if (s->traced) {
        s->traced[3 * done] = c->t0 * 1e6;
        s->traced[3 * done + 1] = (c->t0 + t) * 1e6;
        s->traced[3 * done + 2] = c->port;
      }
      s->out[3 * done + 1] = timing(b, bn, "\"prompt_ms\":");
      s->out[3 * done + 2] = timing(b, bn, "\"predicted_ms\":");
      done++;
      memmove(c->buf, c->buf + whole, c->len - whole);
      c->len -= whole;
      if (sent < s->count) {
        sent++;
        c->t0 = now_ms();
        if (write(c->fd, s->req, (size_t)s->req_len) != s->req_len) die("write");
      }
    }
  }
  return NULL;
}

int main(int argc, char **argv) {
  if (argc != 5 && argc != 6) {
    fprintf(stderr, "usage: http_load PORT|unix:SOCKET CONCURRENCY COUNT BODY_FILE [THREADS]\n");
    return 2;
  }
  const int port = atoi(argv[1]), conc = atoi(argv[2]), count = atoi(argv[3]);
  const int threads = argc == 6 ? atoi(argv[5]) : 1;
  if (conc < 1 || conc > MAX_CONN || count < 1 || threads < 1 || threads > conc) {
    fprintf(stderr, "http_load: bad concurrency, count or threads\n");
    return 2;
  }
  FILE *f = fopen(argv[4], "rb");
  if (!f) die(argv[4]);
  static char body[BUF];
  const size_t body_len = fread(body, 1, sizeof body, f);
  fclose(f);
  if (strncmp(argv[1], "unix:", 5) == 0) return worker_load(argv[1] + 5, conc, count, body, body_len);
  static char req[BUF + 512];
  const int req_len = snprintf(req, sizeof req,
                               "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                               "Content-Length: %zu\r\n\r\n%.*s",
                               body_len, (int)body_len, body);

  double *out = malloc(sizeof(double) * 3 * (size_t)count);
  if (getenv("HTTP_LOAD_TRACE") && strcmp(getenv("HTTP_LOAD_TRACE"), "1") == 0) {
    traced = malloc(sizeof(double) * 3 * (size_t)count);
    if (!traced) die("malloc");
  }
  struct share shares[MAX_CONN];
  pthread_t tids[MAX_CONN];
  if (!out) die("malloc");
  for (int t = 0, first = 0, given = 0; t < threads; t++) {
    struct share *s = &shares[t];
    s->port = port;
    s->first = first;
    s->conc = conc / threads + (t < conc % threads);
    s->count = count / threads + (t < count % threads);
    s->req = req;
    s->req_len = req_len;
    s->out = out + 3 * given;
    s->traced = traced ? traced + 3 * given : NULL;
    s->failed = 0;
    first += s->conc;
    given += s->count;
    if (pthread_create(&tids[t], NULL, http_share, s) != 0) die("pthread_create");
  }
  int failed = 0;
  for (int t = 0; t < threads; t++) {
    pthread_join(tids[t], NULL);
    failed |= shares[t].failed;
  }
  if (failed) return 1;
  print(out, count);
  return 0;
}

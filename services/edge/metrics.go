package main

import (
	"fmt"
	"log"
	"net"
	"net/http"
	"net/http/pprof"
	"sort"
	"strings"
	"sync"
	"time"

	nats "github.com/nats-io/nats.go"
	"google.golang.org/grpc/codes"
)

type callKey struct {
	method string
	code   codes.Code
}

// stats counts the calls carried over the bus and those proxied to the
// upstream gateway port, for /metrics.
type stats struct {
	mu      sync.Mutex
	calls   map[callKey]uint64
	seconds map[string]float64
	passed  map[callKey]uint64
	frames  uint64 // reply frames received
	framed  uint64 // answers that came in them
	broken  uint64 // reply frames cut short
	orphans uint64 // calls no gateway claimed any more (errOrphaned)
	cutoffs uint64 // calls waiting when the NATS connection dropped (errCutOff)
}

// gaveUp counts n calls the edge answered itself for `why` (errOrphaned or errCutOff).
func (s *stats) gaveUp(why error, n int) {
	if s == nil {
		return
	}
	s.mu.Lock()
	if why == errOrphaned {
		s.orphans += uint64(n)
	} else {
		s.cutoffs += uint64(n)
	}
	s.mu.Unlock()
}

// frame counts one reply frame of n answers (err: it was cut short after them).
func (s *stats) frame(n int, err error) {
	if s == nil {
		return
	}
	s.mu.Lock()
	s.frames++
	s.framed += uint64(n)
	if err != nil {
		s.broken++
	}
	s.mu.Unlock()
	if err != nil {
		// The calls it did not reach end at their deadlines.
		log.Printf("edge: %v", err)
	}
}

func newStats() *stats {
	return &stats{calls: map[callKey]uint64{}, seconds: map[string]float64{}, passed: map[callKey]uint64{}}
}

// proxied counts one call passed through to the upstream gateway port.
func (s *stats) proxied(method string, code codes.Code) {
	name := strings.TrimPrefix(method, service)
	s.mu.Lock()
	s.passed[callKey{name, code}]++
	s.mu.Unlock()
}

func sortedKeys(m map[callKey]uint64) []callKey {
	keys := make([]callKey, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool {
		if keys[i].method != keys[j].method {
			return keys[i].method < keys[j].method
		}
		return keys[i].code < keys[j].code
	})
	return keys
}

func (s *stats) observe(method string, code codes.Code, took time.Duration) {
	name := strings.TrimPrefix(method, service)
	s.mu.Lock()
	s.calls[callKey{name, code}]++
	s.seconds[name] += took.Seconds()
	s.mu.Unlock()
}

// render writes the Prometheus text exposition of the counters.
func (s *stats) render() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var b strings.Builder
	b.WriteString("# HELP inferbus_edge_requests_total Calls the edge carried over NATS, by method and gRPC status.\n")
	b.WriteString("# TYPE inferbus_edge_requests_total counter\n")
	counts := map[string]uint64{}
	for _, k := range sortedKeys(s.calls) {
		fmt.Fprintf(&b, "inferbus_edge_requests_total{method=%q,code=%q} %d\n", k.method, k.code.String(), s.calls[k])
		counts[k.method] += s.calls[k]
	}
	b.WriteString("# HELP inferbus_edge_request_seconds Time from a call's request read to its answer, over NATS.\n")
	b.WriteString("# TYPE inferbus_edge_request_seconds summary\n")
	methods := make([]string, 0, len(s.seconds))
	for m := range s.seconds {
		methods = append(methods, m)
	}
	sort.Strings(methods)
	for _, m := range methods {
		fmt.Fprintf(&b, "inferbus_edge_request_seconds_sum{method=%q} %g\n", m, s.seconds[m])
		fmt.Fprintf(&b, "inferbus_edge_request_seconds_count{method=%q} %d\n", m, counts[m])
	}
	b.WriteString("# HELP inferbus_edge_proxied_total Calls the edge passed to the upstream gateway port (streams, other services, requests past max_payload), by method and gRPC status.\n")
	b.WriteString("# TYPE inferbus_edge_proxied_total counter\n")
	for _, k := range sortedKeys(s.passed) {
		fmt.Fprintf(&b, "inferbus_edge_proxied_total{method=%q,code=%q} %d\n", k.method, k.code.String(), s.passed[k])
	}
	b.WriteString("# HELP inferbus_edge_reply_frames_total Messages from the gateways that carried several answers (reply frames).\n")
	b.WriteString("# TYPE inferbus_edge_reply_frames_total counter\n")
	fmt.Fprintf(&b, "inferbus_edge_reply_frames_total %d\n", s.frames)
	b.WriteString("# HELP inferbus_edge_framed_answers_total Answers that came in reply frames.\n")
	b.WriteString("# TYPE inferbus_edge_framed_answers_total counter\n")
	fmt.Fprintf(&b, "inferbus_edge_framed_answers_total %d\n", s.framed)
	b.WriteString("# HELP inferbus_edge_reply_frames_broken_total Reply frames cut short (the calls they did not reach end at their deadlines).\n")
	b.WriteString("# TYPE inferbus_edge_reply_frames_broken_total counter\n")
	fmt.Fprintf(&b, "inferbus_edge_reply_frames_broken_total %d\n", s.broken)
	b.WriteString("# HELP inferbus_edge_orphaned_calls_total Calls answered UNAVAILABLE because no gateway claimed them for the orphan time (the gateway that took them was killed or frozen).\n")
	b.WriteString("# TYPE inferbus_edge_orphaned_calls_total counter\n")
	fmt.Fprintf(&b, "inferbus_edge_orphaned_calls_total %d\n", s.orphans)
	b.WriteString("# HELP inferbus_edge_cut_off_calls_total Calls answered UNAVAILABLE because the edge's NATS connection dropped while they waited.\n")
	b.WriteString("# TYPE inferbus_edge_cut_off_calls_total counter\n")
	fmt.Fprintf(&b, "inferbus_edge_cut_off_calls_total %d\n", s.cutoffs)
	return b.String()
}

// serveMetrics serves /metrics on addr and returns the port it took.
// /livez answers while the process runs; /readyz while its NATS connection is up.
// With profiling on, Go's profiler is served under /debug/pprof/ as well.
func serveMetrics(addr string, s *stats, nc *nats.Conn, profiling bool) (int, error) {
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		return 0, err
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/metrics", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; version=0.0.4")
		_, _ = w.Write([]byte(s.render()))
	})
	mux.HandleFunc("/livez", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
		if !nc.IsConnected() {
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = w.Write([]byte("not connected to NATS\n"))
			return
		}
		_, _ = w.Write([]byte("ok\n"))
	})
	if profiling {
		mux.HandleFunc("/debug/pprof/", pprof.Index)
		mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
		mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
		mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
		mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	}
	go func() { _ = http.Serve(lis, mux) }()
	return lis.Addr().(*net.TCPAddr).Port, nil
}

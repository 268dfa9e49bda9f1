package main

// Unit tests of the edge's pure parts (scripts/build-edge.sh --test; run by
// tests/edge/test_edge_go.py). What it does on the wire, against real
// gateways and nats-server, is tested from Python: tests/e2e/test_e2e_edge.py.

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io/ioutil"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	nats "github.com/nats-io/nats.go"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func TestRawCodecKeepsItsOwnCopyOfTheMessage(t *testing.T) {
	var c rawCodec
	buf := []byte("request bytes")
	var f frame
	if err := c.Unmarshal(buf, &f); err != nil {
		t.Fatal(err)
	}
	copy(buf, "XXXXXXX") // gRPC reuses its receive buffer
	if string(f.payload) != "request bytes" {
		t.Fatalf("payload changed with the receive buffer: %q", f.payload)
	}
	out, err := c.Marshal(&f)
	if err != nil || string(out) != "request bytes" {
		t.Fatalf("Marshal = %q, %v", out, err)
	}
	if _, err := c.Marshal("not a frame"); err == nil {
		t.Fatal("Marshal of a non-frame must fail")
	}
	if err := c.Unmarshal(buf, new(string)); err == nil {
		t.Fatal("Unmarshal into a non-frame must fail")
	}
	if c.Name() != "proto" {
		t.Fatalf("the codec must replace gRPC's proto codec, is named %q", c.Name())
	}
}

func TestBusErrorsBecomeStatusesAClientCanActOn(t *testing.T) {
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	live := context.Background()
	cases := []struct {
		ctx  context.Context
		err  error
		code codes.Code
		says string
	}{
		{live, nats.ErrNoResponders, codes.Unavailable, "no gateway process answers on ib.edge.grpc"},
		{cancelled, context.Canceled, codes.Canceled, "cancelled"},
		{live, context.DeadlineExceeded, codes.DeadlineExceeded, "deadline"},
		{live, nats.ErrTimeout, codes.DeadlineExceeded, "deadline"},
		{live, fmt.Errorf("wrapped: %w", nats.ErrConnectionClosed), codes.Unavailable, "lost its NATS connection"},
		{live, nats.ErrDisconnected, codes.Unavailable, "lost its NATS connection"},
		{live, errors.New("something else"), codes.Unavailable, "could not be carried to a gateway: something else"},
	}
	for _, c := range cases {
		got := status.Convert(busError(c.ctx, "ib.edge.grpc", c.err))
		if got.Code() != c.code || !strings.Contains(got.Message(), c.says) {
			t.Errorf("busError(%v) = %v %q, want %v with %q", c.err, got.Code(), got.Message(), c.code, c.says)
		}
	}
}

func TestMetricsAreSortedPrometheusTextWithCountsPerMethod(t *testing.T) {
	s := newStats()
	s.observe(service+"ModelInfer", codes.OK, 250*time.Millisecond)
	s.observe(service+"ModelInfer", codes.OK, 500*time.Millisecond)
	s.observe(service+"ModelInfer", codes.InvalidArgument, 250*time.Millisecond)
	s.observe(service+"ModelReady", codes.OK, time.Millisecond)
	s.proxied(service+"ModelStreamInfer", codes.OK)
	s.proxied("/grpc.health.v1.Health/Check", codes.Unimplemented)
	text := s.render()
	want := []string{
		`inferbus_edge_requests_total{method="ModelInfer",code="OK"} 2`,
		`inferbus_edge_requests_total{method="ModelInfer",code="InvalidArgument"} 1`,
		`inferbus_edge_requests_total{method="ModelReady",code="OK"} 1`,
		`inferbus_edge_request_seconds_sum{method="ModelInfer"} 1`,
		`inferbus_edge_request_seconds_count{method="ModelInfer"} 3`,
		`inferbus_edge_request_seconds_count{method="ModelReady"} 1`,
		`inferbus_edge_proxied_total{method="/grpc.health.v1.Health/Check",code="Unimplemented"} 1`,
		`inferbus_edge_proxied_total{method="ModelStreamInfer",code="OK"} 1`,
	}
	at := -1
	for _, line := range want {
		i := strings.Index(text, line+"\n")
		if i < 0 {
			t.Fatalf("missing %q in:\n%s", line, text)
		}
		if i < at {
			t.Fatalf("%q is out of order in:\n%s", line, text)
		}
		at = i
	}
	for _, line := range strings.Split(strings.TrimSpace(text), "\n") {
		if strings.HasPrefix(line, "#") {
			if !strings.HasPrefix(line, "# HELP inferbus_edge_") && !strings.HasPrefix(line, "# TYPE inferbus_edge_") {
				t.Errorf("comment line that is neither HELP nor TYPE: %q", line)
			}
			continue
		}
		if fields := strings.Fields(line); len(fields) != 2 {
			t.Errorf("sample line is not `name{labels} value`: %q", line)
		}
	}
}

func TestPortsFileIsWholeJSONAndNothingIsLeftBeside(t *testing.T) {
	dir, err := ioutil.TempDir("", "edge-ports")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, "edge.json")
	if err := writePortsFile(path, 18003, 18004); err != nil {
		t.Fatal(err)
	}
	raw, err := ioutil.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var got struct{ Pid, Grpc, Metrics int }
	if err := json.Unmarshal(raw, &got); err != nil {
		t.Fatalf("%q is not JSON: %v", raw, err)
	}
	if got.Pid != os.Getpid() || got.Grpc != 18003 || got.Metrics != 18004 {
		t.Fatalf("ports file = %+v", got)
	}
	entries, _ := ioutil.ReadDir(dir)
	if len(entries) != 1 {
		t.Fatalf("the temporary file was left beside the ports file: %d entries", len(entries))
	}
	if err := writePortsFile("", 1, 2); err != nil {
		t.Fatalf("no path means no file, not an error: %v", err)
	}
}

func TestSettingsComeFromInferbusEdgeVariables(t *testing.T) {
	t.Setenv("INFERBUS_EDGE_GRPC_PORT", "9103")
	t.Setenv("INFERBUS_EDGE_HOST", "")
	if got := envInt("GRPC_PORT", 8003); got != 9103 {
		t.Fatalf("envInt = %d, want 9103", got)
	}
	if got := envInt("NOT_SET_BY_ANYONE_PORT", 8004); got != 8004 {
		t.Fatalf("an unset variable must give the default, got %d", got)
	}
	if got := env("HOST", "127.0.0.1"); got != "" {
		t.Fatalf("a variable set to empty is that value, got %q", got)
	}
}

// replyRecord builds one reply frame record as a gateway does.
func replyRecord(id uint64, code codes.Code, meta string, body string) []byte {
	b := make([]byte, recordHead)
	binary.LittleEndian.PutUint64(b, id)
	binary.LittleEndian.PutUint16(b[8:], uint16(code))
	binary.LittleEndian.PutUint32(b[10:], uint32(len(meta)))
	binary.LittleEndian.PutUint32(b[14:], uint32(len(body)))
	return append(append(b, meta...), body...)
}

func TestReplyFrameRecordsReachTheirCalls(t *testing.T) {
	var data []byte
	data = append(data, replyRecord(7, codes.OK, "", "response seven")...)
	data = append(data, replyRecord(8, codes.ResourceExhausted, "over the limit of tenant a\nretry-after:2\ninferbus-reason:rate", "")...)
	data = append(data, replyRecord(9, codes.OK, "\nx-model-version:3", "nine")...)
	got := map[uint64]answer{}
	n, err := parseFrame(data, func(id uint64, a answer) { got[id] = a })
	if err != nil || n != 3 {
		t.Fatalf("parseFrame = %d, %v; want 3 records", n, err)
	}
	if a := got[7]; a.err != nil || string(a.body) != "response seven" || len(a.trailer) != 0 {
		t.Errorf("record 7 = %+v", a)
	}
	a := got[8]
	if s := status.Convert(a.err); s.Code() != codes.ResourceExhausted || s.Message() != "over the limit of tenant a" {
		t.Errorf("record 8's status = %v %q", s.Code(), s.Message())
	}
	if a.trailer["retry-after"][0] != "2" || a.trailer["inferbus-reason"][0] != "rate" {
		t.Errorf("record 8's trailers = %v", a.trailer)
	}
	if a := got[9]; a.err != nil || string(a.body) != "nine" || a.trailer["x-model-version"][0] != "3" {
		t.Errorf("record 9 = %+v", a)
	}
	// A body must not reach past its own record (callers may append to it).
	if cap(got[7].body) != len(got[7].body) {
		t.Errorf("record 7's body shares capacity with the next record")
	}
}

func TestACutShortReplyFrameDeliversTheRecordsBeforeTheCut(t *testing.T) {
	whole := append(replyRecord(1, codes.OK, "", "one"), replyRecord(2, codes.OK, "", "two")...)
	for _, cut := range []int{len(whole) - 1, len(whole) - 4, len(replyRecord(1, codes.OK, "", "one")) + 5} {
		var ids []uint64
		n, err := parseFrame(whole[:cut], func(id uint64, _ answer) { ids = append(ids, id) })
		if err == nil || n != 1 || len(ids) != 1 || ids[0] != 1 {
			t.Errorf("cut at %d: parseFrame = %d, %v, delivered %v; want record 1 and an error", cut, n, err, ids)
		}
	}
}

func TestAnswersOnACallsOwnSubject(t *testing.T) {
	noOne := &nats.Msg{Header: nats.Header{"Status": {"503"}}}
	if a := answerFromHeaders(noOne); a.busErr != nats.ErrNoResponders {
		t.Errorf("nats-server's 503 must read as no responders, got %+v", a)
	}
	refused := &nats.Msg{Header: nats.Header{
		"Ib-Status": {"3"}, "Ib-Message": {"input 'x' has shape [2]"}, "inferbus-reason": {"shape"},
	}}
	a := answerFromHeaders(refused)
	if s := status.Convert(a.err); s.Code() != codes.InvalidArgument || s.Message() != "input 'x' has shape [2]" {
		t.Errorf("status = %v %q", s.Code(), s.Message())
	}
	if a.trailer["inferbus-reason"][0] != "shape" {
		t.Errorf("trailers = %v", a.trailer)
	}
	garbled := &nats.Msg{Header: nats.Header{"Ib-Status": {"eight"}}}
	if s := status.Convert(answerFromHeaders(garbled).err); s.Code() != codes.Internal {
		t.Errorf("an unreadable status must be INTERNAL, got %v", s.Code())
	}
	ok := &nats.Msg{Data: []byte("response"), Header: nats.Header{}}
	if a := answerFromHeaders(ok); a.err != nil || string(a.body) != "response" {
		t.Errorf("a plain answer = %+v", a)
	}
}

func TestCallsGetTheirOwnAnswerOnceAndAForgottenCallNone(t *testing.T) {
	c := &calls{waiting: map[uint64]*pending{}, base: "_INBOX.test"}
	a, b, gone := c.open(), c.open(), c.open()
	if b.id != a.id+1 || b.reply != fmt.Sprintf("_INBOX.test.c.%d", b.id) {
		t.Fatalf("ids %d %d, reply subject %q", a.id, b.id, b.reply)
	}
	c.forget(gone) // its deadline passed
	frame := append(replyRecord(b.id, codes.OK, "", "for b"), replyRecord(gone.id, codes.OK, "", "late")...)
	c.onMsg(&nats.Msg{Subject: c.framesSubject(), Data: frame})
	if got := <-b.answered; string(got.body) != "for b" {
		t.Errorf("b got %q", got.body)
	}
	if len(gone.answered) != 0 || len(a.answered) != 0 {
		t.Errorf("an answer reached a call it was not for")
	}
	// On the call's own subject: a gateway without frames, or nats-server's no responders.
	c.onMsg(&nats.Msg{Subject: a.reply, Header: nats.Header{"Status": {"503"}}})
	if got := <-a.answered; got.busErr != nats.ErrNoResponders {
		t.Errorf("a got %+v, want no responders", got)
	}
	c.onMsg(&nats.Msg{Subject: b.reply, Data: []byte("a duplicate")})
	if len(b.answered) != 0 {
		t.Errorf("a second answer reached b")
	}
	if len(c.waiting) != 0 {
		t.Errorf("%d calls still wait", len(c.waiting))
	}
}

func claim(ids ...uint64) []byte {
	out := make([]byte, 0, 8*len(ids))
	for _, id := range ids {
		out = binary.LittleEndian.AppendUint64(out, id)
	}
	return out
}

func TestACallNoGatewayClaimsIsAnsweredUnavailableAndAClaimedOneWaits(t *testing.T) {
	c := &calls{waiting: map[uint64]*pending{}, base: "_INBOX.test"}
	held, orphan, fresh := c.open(), c.open(), c.open()
	start := time.Now()
	held.since, orphan.since = start.Add(-3*time.Second), start.Add(-3*time.Second)
	// A gateway claims `held` (and an id the edge no longer waits for, and a
	// torn last id): only `orphan` is older than the orphan time.
	c.onMsg(&nats.Msg{Subject: "_INBOX.test.k", Data: append(claim(held.id, 999), 1, 2, 3)})
	if n := c.expire(start, time.Second); n != 1 {
		t.Fatalf("expired %d calls, want 1", n)
	}
	got := <-orphan.answered
	if !errors.Is(got.busErr, errOrphaned) {
		t.Fatalf("the orphan got %+v", got)
	}
	if s := status.Convert(busError(context.Background(), "ib.edge.grpc", got.busErr)); s.Code() != codes.Unavailable ||
		!strings.Contains(s.Message(), "stopped before answering (killed or frozen: no gateway has held the call for 1s)") {
		t.Errorf("an orphaned call's status = %v %q", s.Code(), s.Message())
	}
	if len(held.answered) != 0 || len(fresh.answered) != 0 || len(c.waiting) != 2 {
		t.Errorf("a claimed or fresh call was answered (%d still wait)", len(c.waiting))
	}
	// Its claim ages too: with no claim for the orphan time it goes as well.
	if n := c.expire(time.Now().Add(2*time.Second), time.Second); n != 2 {
		t.Errorf("expired %d, want the 2 left", n)
	}
}

func TestCallsWaitingWhenTheConnectionDropsAreAnsweredAtOnce(t *testing.T) {
	c := &calls{waiting: map[uint64]*pending{}, base: "_INBOX.test"}
	a, b := c.open(), c.open()
	if n := c.cutOff(); n != 2 {
		t.Fatalf("cut off %d, want 2", n)
	}
	for _, p := range []*pending{a, b} {
		got := <-p.answered
		if s := status.Convert(busError(context.Background(), "ib.edge.grpc", got.busErr)); s.Code() != codes.Unavailable ||
			!strings.Contains(s.Message(), "lost its NATS connection") {
			t.Errorf("call %d: %v %q", p.id, s.Code(), s.Message())
		}
	}
	// The answers that come after the reconnect reach no one.
	c.deliver(a.id, answer{body: []byte("late")})
	if len(a.answered) != 0 || len(c.waiting) != 0 {
		t.Errorf("a late answer was delivered")
	}
}

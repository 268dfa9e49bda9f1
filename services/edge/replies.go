package main

// Answers from the gateways, and reply frames.
//
// Each call the edge carries is published with a reply subject of its own,
// <base>.c.<id>, and the header Ib-Reply-Frames: <base>.r. A gateway that knows
// frames gathers the answers it has ready at one moment for one Ib-Reply-Frames
// subject (those of a bundle's requests come back together) into one message
// on that subject, a sequence of records, little-endian:
//
//	uint64 id | uint16 gRPC status | uint32 meta length | uint32 body length | meta | body
//
// meta is the status message, then one "key:value" line per trailer, "\n"
// between lines (empty for OK without trailers); body is the response's
// protobuf bytes. A gateway without frames answers on the call's own subject
// with headers (Ib-Status, Ib-Message, trailers), as before; nats-server answers
// there too, with status 503, when no gateway is subscribed.
//
// Claims: a gateway tells the edge, on <base>.k, which of its calls it still
// holds: a message of little-endian uint64 call ids, every 250 ms, for the calls
// it has held longer than that (so a call answered within 250 ms costs no claim).
// A call that no gateway has claimed for -orphan-after (1 s) since it was sent
// or last claimed is answered UNAVAILABLE: the gateway process that took it was
// killed or is frozen, and its answer will not come. Without claims such a call
// waited out the client's whole deadline. Gateways from before claims never
// claim: with those, set -orphan-after 0 (off).
//
// Why frames: on the edge's hop each call cost four messages through nats-server
// (request in and out, answer in and out), each one a delivery and a wake-up of
// nats-server, the gateway's client and this one; a frame answers a bundle's
// calls with one (bench/findings.md, round 19). The requests stay one message
// per call: they arrive one by one, and frames of them gained nothing there.

import (
	"encoding/binary"
	"errors"
	"fmt"
	"log"
	"strconv"
	"strings"
	"sync"
	"time"

	nats "github.com/nats-io/nats.go"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// answer is what came back for one call.
type answer struct {
	err     error // the call's gRPC status when not OK
	trailer metadata.MD
	body    []byte
	busErr  error // the bus brought no answer (nats.ErrNoResponders, a publish error)
}

// The bus errors of calls the edge itself gives up on.
var (
	// errOrphaned: no gateway has claimed the call for the orphan time.
	errOrphaned = errors.New("no gateway has held the call")
	// errCutOff: the edge's NATS connection dropped while the call waited.
	errCutOff = errors.New("the NATS connection dropped while the call waited")
)

// pending is one call waiting for its answer.
type pending struct {
	id       uint64
	reply    string      // <base>.c.<id>
	answered chan answer // buffered: one answer
	since    time.Time   // sent, or last claimed by a gateway (under calls.mu)
}

const recordHead = 18 // id 8, status 2, meta length 4, body length 4

// calls matches answers to the calls waiting for them.
type calls struct {
	mu      sync.Mutex
	next    uint64
	waiting map[uint64]*pending
	base    string
	stats   *stats
}

// newCalls subscribes to the edge's answer subjects (<inbox>.>).
func newCalls(nc *nats.Conn, st *stats) (*calls, error) {
	c := &calls{waiting: map[uint64]*pending{}, base: nc.NewInbox(), stats: st}
	sub, err := nc.Subscribe(c.base+".>", c.onMsg)
	if err != nil {
		return nil, err
	}
	// Answers are handed on at once; never drop one as a slow consumer.
	if err := sub.SetPendingLimits(-1, -1); err != nil {
		return nil, err
	}
	return c, nil
}

// framesSubject is where gateways send reply frames.
func (c *calls) framesSubject() string { return c.base + ".r" }

// open registers a call: its id, its reply subject, where its answer arrives.
func (c *calls) open() *pending {
	p := &pending{answered: make(chan answer, 1), since: time.Now()}
	c.mu.Lock()
	c.next++
	p.id = c.next
	c.waiting[p.id] = p
	c.mu.Unlock()
	p.reply = c.base + ".c." + strconv.FormatUint(p.id, 10)
	return p
}

// forget drops a call that stopped waiting (deadline, cancel, publish error).
func (c *calls) forget(p *pending) {
	c.mu.Lock()
	delete(c.waiting, p.id)
	c.mu.Unlock()
}

func (c *calls) deliver(id uint64, a answer) {
	c.mu.Lock()
	p, ok := c.waiting[id]
	delete(c.waiting, id)
	c.mu.Unlock()
	if ok { // else: the call stopped waiting, or a duplicate
		p.answered <- a
	}
}

// claimed marks the calls of a claims message as held by a gateway now.
func (c *calls) claimed(data []byte) {
	now := time.Now()
	c.mu.Lock()
	for ; len(data) >= 8; data = data[8:] {
		if p, ok := c.waiting[binary.LittleEndian.Uint64(data)]; ok {
			p.since = now
		}
	}
	c.mu.Unlock()
}

// expire answers, with errOrphaned, the calls not sent or claimed in the
// `after` before `now`; it returns how many.
func (c *calls) expire(now time.Time, after time.Duration) int {
	before := now.Add(-after)
	orphaned := fmt.Errorf("%w for %v", errOrphaned, after)
	var gone []*pending
	c.mu.Lock()
	for id, p := range c.waiting {
		if p.since.Before(before) {
			gone = append(gone, p)
			delete(c.waiting, id)
		}
	}
	c.mu.Unlock()
	for _, p := range gone {
		p.answered <- answer{busErr: orphaned}
	}
	return len(gone)
}

// watch expires orphaned calls (no claim for `after`), checking four times
// per `after`, for the life of the process.
func (c *calls) watch(after time.Duration) {
	for now := range time.Tick(after / 4) {
		if n := c.expire(now, after); n > 0 {
			c.stats.gaveUp(errOrphaned, n)
			log.Printf("edge: %d call(s) no gateway claimed for %v answered UNAVAILABLE (the gateway that took them stopped?)", n, after)
		}
	}
}

// cutOff answers every waiting call with errCutOff: the answers on their way
// were lost with the connection. It returns how many.
func (c *calls) cutOff() int {
	c.mu.Lock()
	gone := c.waiting
	c.waiting = map[uint64]*pending{}
	c.mu.Unlock()
	for _, p := range gone {
		p.answered <- answer{busErr: errCutOff}
	}
	c.stats.gaveUp(errCutOff, len(gone))
	return len(gone)
}

func (c *calls) onMsg(msg *nats.Msg) {
	rest := strings.TrimPrefix(msg.Subject, c.base+".")
	if rest == "r" {
		n, err := parseFrame(msg.Data, c.deliver)
		c.stats.frame(n, err)
		return
	}
	if rest == "k" {
		c.claimed(msg.Data)
		return
	}
	if strings.HasPrefix(rest, "c.") {
		id, err := strconv.ParseUint(rest[2:], 10, 64)
		if err == nil {
			c.deliver(id, answerFromHeaders(msg))
		}
	}
}

// answerFromHeaders reads an answer sent on the call's own subject.
func answerFromHeaders(msg *nats.Msg) answer {
	if len(msg.Data) == 0 && msg.Header.Get("Status") == "503" {
		return answer{busErr: nats.ErrNoResponders}
	}
	a := answer{trailer: metadata.MD{}, body: msg.Data}
	code := codes.OK
	text := ""
	for key, values := range msg.Header {
		switch key {
		case "Ib-Status":
			n, err := strconv.Atoi(values[0])
			if err != nil {
				return answer{err: status.Errorf(codes.Internal, "edge: a gateway answered with status %q", values[0])}
			}
			code = codes.Code(n)
		case "Ib-Message":
			text = values[0]
		default:
			if key == strings.ToLower(key) {
				a.trailer[key] = values
			}
		}
	}
	if code != codes.OK {
		a.err = status.Error(code, text)
	}
	return a
}

// parseFrame hands each record of a reply frame to deliver; it returns the
// records read, and an error for a frame cut short (the records before it are
// delivered).
func parseFrame(data []byte, deliver func(uint64, answer)) (int, error) {
	n := 0
	for len(data) > 0 {
		if len(data) < recordHead {
			return n, fmt.Errorf("a reply frame ends inside a record's head (%d bytes left)", len(data))
		}
		id := binary.LittleEndian.Uint64(data)
		code := codes.Code(binary.LittleEndian.Uint16(data[8:]))
		metaLen := uint64(binary.LittleEndian.Uint32(data[10:]))
		bodyLen := uint64(binary.LittleEndian.Uint32(data[14:]))
		data = data[recordHead:]
		if uint64(len(data)) < metaLen+bodyLen {
			return n, fmt.Errorf("a reply frame's record %d says %d bytes, %d are left", id, metaLen+bodyLen, len(data))
		}
		a := answer{body: data[metaLen : metaLen+bodyLen : metaLen+bodyLen]}
		if metaLen > 0 {
			lines := strings.Split(string(data[:metaLen]), "\n")
			if code != codes.OK {
				a.err = status.Error(code, lines[0])
			}
			for _, line := range lines[1:] {
				if i := strings.IndexByte(line, ':'); i > 0 {
					if a.trailer == nil {
						a.trailer = metadata.MD{}
					}
					a.trailer[line[:i]] = append(a.trailer[line[:i]], line[i+1:])
				}
			}
		} else if code != codes.OK {
			a.err = status.Error(code, "")
		}
		data = data[metaLen+bodyLen:]
		deliver(id, a)
		n++
	}
	return n, nil
}

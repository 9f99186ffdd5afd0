// Package queue is the store: it owns the Redis layout of an orderdelay
// queue and the rules every producer and consumer agree on — how companion
// keys are named (Keys), which members are valid order serials and which
// scores valid deadlines, the records kept beside entries (DeadRecord,
// ListItem, the meta hash, PauseState) — and the Lua scripts that change them, each
// beside the typed method of Store that runs it and returns a result
// struct. It knows nothing of metrics or logging; callers count and log.
//
// Where things are: store.go (Store), lease.go (the lease protocol: the
// shared Lua helpers and serial rule, claim, finish, retry, fence, later,
// bury, hand-back, in-queue, stats), leaserecord.go (the lease record's
// codec, LeaseRecord, and LeaseRecords), poll.go (a poll's claim:
// PollTasks and Task), tasklease.go (the poll token and a poll's ack,
// extend, retry, bury and release), forward.go (stream and
// list actions' forward), peek.go (the dry run's read and the scan loop's
// head check), orders.go (order enqueue, get, cancel and the sharded
// client's lookup), dead.go (dead letters: list, requeue, purge; the
// dead-letter record), taskops.go (task queues' paging, requeue and
// purge), tasks.go (task put, delete, payloads; the reliable list's take
// and ack; the list item), stream.go (stream groups and the bury of
// exhausted entries), pause.go (the pause flag),
// extend.go (moving deadlines later), events.go (the close events the
// relay adds to the events stream), meta.go (the meta hash, task
// queues' default keys), nextdue.go (the long poll's wait), listitem.go
// (the Lua list-item splitter), shard.go (shard keys and hash slots),
// unbatch.go (batch leases back to per-member ones, for a rollback).
//
// Every Lua script of orderdelay is here. Outside the store, the daemon's
// consumer (internal/consumer) talks to Redis directly only to subscribe
// to the wake-up channel; the demo command writes as a raw producer would.
//
// It depends on go-redis and the standard library only, so the public
// client package shares it without inheriting the daemon's dependencies.
//
// Layout of a queue whose key is Q (default "delaytask:order"):
//
//	Q                  sorted set: serial -> deadline (Unix ms) of entries not leased
//	{Q}:inflight       sorted set: serial -> lease (or backoff) expiry, Unix ms
//	{Q}:deadlines      sorted set: serial -> true deadline of an inflight entry
//	{Q}:lease          hash: serial -> "deadline|attempts|token|last error"
//	{Q}:dead           sorted set: serial -> time it was dead-lettered, Unix ms
//	{Q}:deadinfo       hash: serial -> "reason|attempts|deadline|last error"
//	{Q}:wake           pub/sub channel: deadline of a newly added entry
//	{Q}:paused         string: "since ms|reason" while closing is paused (absent: not paused)
//	{Q}:events         stream: close events (ORDERDELAY_CLOSE_EVENTS)
//
// Task queues (named queues with payloads) add:
//
//	{Q}:payload        hash: task id -> payload (JSON), written and removed with the entry;
//	                   a dead letter keeps it until purged (unless a live task of its id owns it)
//	{Q}:stream         stream: due tasks forwarded by the "stream" action
//	{Q}:ready          list: due tasks forwarded by the "list" action
//	{Q}:processing     list: tasks a reliable list consumer has taken
//	{Q}:unacked        sorted set: task id -> when a taken task returns to ready
//	{Q}:taken          hash: task id -> the list item a consumer took
//	{Q}:meta           hash: what the daemon's queues file says of the queue:
//	                   durable (1 or 0) and max_pending for producers' scripts,
//	                   name for client.ForQueue
//	{Q}:name           string: obsolete (the name before the meta hash held it),
//	                   deleted by the daemon at start
//
// Redis Cluster hashes only the part in braces, so every companion lands in
// the same slot as Q itself and one script may touch them all.
package queue

import (
	"errors"
	"fmt"
	"time"
	"unicode"
	"unicode/utf8"
)

// DefaultKey is the queue key used when none is configured.
const DefaultKey = "delaytask:order"

// MaxSerialLen is the longest serial, in bytes, that a queue accepts.
const MaxSerialLen = 128

// MinDeadline is the earliest deadline a queue accepts (2000-01-01 UTC), in
// Unix milliseconds. Anything smaller is almost certainly a producer writing
// seconds instead of milliseconds.
const MinDeadline int64 = 946684800000

// MaxAhead is how far in the future a deadline may lie.
const MaxAhead = 10 * 365 * 24 * time.Hour

// Keys holds the names of every Redis key of one queue. Build it with
// NewKeys; it is the only place key names are made.
type Keys struct {
	Queue     string // the sorted set producers ZADD to
	Inflight  string // leased and backing-off entries, scored by expiry
	Deadlines string // the same entries, scored by their true deadline
	Lease     string // per-entry lease record
	// Batch leases of the order queue (see lease.go): Leases
	// scores each claim's token by its lease expiry; LeaseBatch holds, per
	// token, the members it leased (field token), how many of them it
	// still holds (field "#"+token) and the oldest of their deadlines
	// (field "<"+token).
	Leases     string
	LeaseBatch string
	Dead       string // dead-letter set, scored by time of death
	DeadInfo   string // per-entry dead-letter record
	Wake       string // pub/sub channel announcing new early deadlines
	Paused     string // present while closing is paused; holds the reason
	Events     string // stream of close events

	// Task queues only.
	Payload     string // task id -> payload
	Stream      string // stream action target
	Ready       string // list action target
	Processing  string // reliable list consumers' taken items
	Unacked     string // taken task id -> when it was taken (Unix ms, Redis clock)
	Taken       string // taken task id -> list item
	Deliveries  string // reliable list: task id -> times taken so far
	DeliveryIDs string // reliable list: taken task id -> its delivery's number
	DeliverySeq string // reliable list: field "n" -> the last delivery sequence number given
	Name        string // obsolete: the queue's name, written by daemons before MetaName; deleted at start
	Meta        string // the daemon's settings producers' scripts obey (MetaDurable, MetaMaxPending)
}

// Fields of a task queue's Meta hash, written by the daemon at start (and
// refreshed while it runs) from its queues file, read by the put and delete
// scripts of package client. An absent hash or field (a daemon older than
// these fields, or none started yet) means: not durable, no cap.
const (
	// MetaDurable is "1" when the queue is durable: its tasks live in
	// PostgreSQL and only the daemon's durable tier may write its Redis
	// keys; "0" otherwise.
	MetaDurable = "durable"
	// MetaMaxPending is the queue's cap on pending tasks (queued plus
	// leased or backing off), a decimal integer.
	MetaMaxPending = "max_pending"
	// MetaName is the queue's name in the queues file; client.ForQueue
	// serves a name only where the meta hash at the name's default key
	// holds that name (and the queue is not durable).
	MetaName = "name"
)

// NewKeys returns the keys of the queue named key. It does not validate key;
// see ValidateKey.
func NewKeys(key string) Keys {
	tag := "{" + key + "}:"
	return Keys{
		Queue:      key,
		Inflight:   tag + "inflight",
		Deadlines:  tag + "deadlines",
		Lease:      tag + "lease",
		Leases:     tag + "leases",
		LeaseBatch: tag + "leasebatch",
		Dead:       tag + "dead",
		DeadInfo:   tag + "deadinfo",
		Wake:       tag + "wake",
		Paused:     tag + "paused",
		Events:     tag + "events",

		Payload:     tag + "payload",
		Stream:      tag + "stream",
		Ready:       tag + "ready",
		Processing:  tag + "processing",
		Unacked:     tag + "unacked",
		Taken:       tag + "taken",
		Deliveries:  tag + "deliveries",
		DeliveryIDs: tag + "deliveryids",
		DeliverySeq: tag + "deliveryseq",
		Name:        tag + "name",
		Meta:        tag + "meta",
	}
}

// ValidateKey reports whether key can name a queue. Braces are refused
// because they would change which part of the key Redis Cluster hashes.
func ValidateKey(key string) error {
	switch {
	case key == "":
		return errors.New("queue key is empty")
	case len(key) > 200:
		return errors.New("queue key is longer than 200 bytes")
	}
	for _, r := range key {
		if r == '{' || r == '}' || unicode.IsControl(r) || unicode.IsSpace(r) {
			return fmt.Errorf("queue key %q contains %q: use letters, digits and punctuation other than braces", key, r)
		}
	}
	return nil
}

// Reasons an entry is refused or dead-lettered. They are stable strings:
// metric labels and dead-letter records use them.
const (
	ReasonMalformed       = "malformed"
	ReasonScoreOutOfRange = "score_out_of_range"
	ReasonNotFound        = "not_found"
	ReasonCloseFailed     = "close_failed"
)

// ReasonFailed dead-letters a task whose action kept failing, or whose
// poll's lease expired MaxAttempts times. Task queues only.
const ReasonFailed = "failed"

// DeadReasons lists every dead-letter reason of the order queue, for
// pre-creating metric labels.
var DeadReasons = []string{ReasonMalformed, ReasonScoreOutOfRange, ReasonNotFound, ReasonCloseFailed}

// ErrInvalidSerial is wrapped by every error ValidateSerial returns.
var ErrInvalidSerial = errors.New("invalid serial")

// ErrInvalidDeadline is wrapped by every error ValidateDeadline returns.
var ErrInvalidDeadline = errors.New("invalid deadline")

// ValidateSerial reports whether s is a valid order serial: 1 to 128 bytes of
// UTF-8 without control characters. The claim script applies the same rule
// to members written by raw ZADD producers (see the tests that hold the two
// in agreement).
func ValidateSerial(s string) error {
	switch {
	case s == "":
		return fmt.Errorf("%w: empty", ErrInvalidSerial)
	case len(s) > MaxSerialLen:
		return fmt.Errorf("%w: %d bytes, at most %d allowed", ErrInvalidSerial, len(s), MaxSerialLen)
	case !utf8.ValidString(s):
		return fmt.Errorf("%w: not valid UTF-8", ErrInvalidSerial)
	}
	for _, r := range s {
		if unicode.IsControl(r) {
			return fmt.Errorf("%w: contains control character %U", ErrInvalidSerial, r)
		}
	}
	return nil
}

// DeadlineMillis converts t to Unix milliseconds, rounding up so that a
// deadline is never moved earlier.
func DeadlineMillis(t time.Time) int64 {
	ms := t.UnixMilli()
	if time.UnixMilli(ms).Before(t) {
		ms++
	}
	return ms
}

// ValidateDeadline reports whether ms is an acceptable deadline relative to
// now: not before 2000-01-01 and not more than MaxAhead after now.
func ValidateDeadline(ms int64, now time.Time) error {
	if ms < MinDeadline {
		return fmt.Errorf("%w: %d ms is before 2000-01-01 (seconds instead of milliseconds?)", ErrInvalidDeadline, ms)
	}
	if max := now.Add(MaxAhead).UnixMilli(); ms > max {
		return fmt.Errorf("%w: %s is more than 10 years ahead", ErrInvalidDeadline, time.UnixMilli(ms).UTC().Format(time.RFC3339))
	}
	return nil
}

// ValidQueueName reports whether s is a task queue's name as the queues
// file allows it: 1 to 64 bytes of a-z, 0-9, '_' and '-'. Names appear in
// API paths and in the `queue` metric label.
func ValidQueueName(s string) bool {
	if s == "" || len(s) > 64 {
		return false
	}
	for _, r := range s {
		if !(r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || r == '_' || r == '-') {
			return false
		}
	}
	return true
}

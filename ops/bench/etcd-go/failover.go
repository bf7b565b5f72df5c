package main

import (
	"context"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"go.etcd.io/etcd/clientv3"
)

// failover is loadgen's `failover` scenario (loadgen/src/scenarios/failover.rs) with
// clientv3: 16 writers, each putting its own key in a loop (a failed put retried after
// 20 ms, each with the request deadline), on three clients (one per member to start at,
// as loadgen's "at least a client per member"); 3 s in the leader is killed or frozen,
// and the writers go on for 12 s (20 s frozen). Unavailability is loadgen's: from the
// fault to the first write that succeeded after it, or the longest gap between successes
// after it if longer.
func failover(eps []string, ms []member, freeze bool, timeout time.Duration) map[string]any {
	const writers = 16
	clients := make([]*clientv3.Client, maxI(len(eps), 1))
	for i := range clients {
		c, err := clientv3.New(config(eps, i))
		must(err)
		clients[i] = c
	}
	for i := 0; i < writers; i++ {
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		_, err := clients[i%len(clients)].Put(ctx, fmt.Sprintf("/bench-w%d", i), "0")
		cancel()
		must(err)
	}
	var (
		stop   atomic.Bool
		failed atomic.Int64
		mu     sync.Mutex
		done   []time.Time
		wr     lat
		wg     sync.WaitGroup
	)
	for i := 0; i < writers; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			c := clients[i%len(clients)]
			for v := 1; !stop.Load(); {
				t0 := time.Now()
				ctx, cancel := context.WithTimeout(context.Background(), timeout)
				_, err := c.Put(ctx, fmt.Sprintf("/bench-w%d", i), fmt.Sprint(v))
				cancel()
				t1 := time.Now()
				if err != nil {
					failed.Add(1)
					why(err)
					time.Sleep(20 * time.Millisecond)
					continue
				}
				wr.add(t1.Sub(t0))
				mu.Lock()
				done = append(done, t1)
				mu.Unlock()
				v++
			}
		}(i)
	}
	after := 12 * time.Second
	sig, name := syscall.SIGKILL, "kill"
	if freeze {
		after, sig, name = 20*time.Second, syscall.SIGSTOP, "freeze"
	}
	time.Sleep(3 * time.Second)
	l := leader(clients[0], ms)
	if l == nil {
		stop.Store(true)
		wg.Wait()
		fmt.Fprintln(os.Stderr, "etcd-profile: no leader found for the fault")
		os.Exit(1)
	}
	event := time.Now()
	must(syscall.Kill(l.pid, sig))
	time.Sleep(after)
	stop.Store(true)
	wg.Wait()
	if freeze {
		_ = syscall.Kill(l.pid, syscall.SIGCONT)
	}
	gap := unavailable(done, event, after)
	// The first write that succeeded after the fault, and how long the slowest write
	// took: a long gap after an early first success is a stall, not a late recovery.
	first := after.Seconds()
	for _, t := range done {
		if t.After(event) && t.Sub(event).Seconds() < first {
			first = t.Sub(event).Seconds()
		}
	}
	return map[string]any{
		"scenario":                        "failover (" + name + ")",
		"writers":                         writers,
		"clients":                         len(clients),
		"leader":                          fmt.Sprintf("%s (%s)", l.name, l.addr),
		"writes unavailable (s)":          gap,
		"first write after the fault (s)": first,
		"write":                           wr.row(failed.Load()),
		"failed attempts, by gRPC code":   reasons,
	}
}

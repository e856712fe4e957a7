//! The batch runner's result writer: items' results written together, a
//! group per transaction, one write at a time.
//!
//! Why not one transaction per item: with many items in flight their
//! writes queued on the store's few connections and on the batch row's
//! lock, and after a store outage every waiting item retried at once. Each
//! write then waited its turn for most of `store_timeout`, so writes timed
//! out while connecting, connections were dropped and made again, and the
//! batch crawled (PostgreSQL logged thousands of clients gone mid-
//! transaction). Here an item hands its result over and waits for the
//! answer; the writer takes whatever has arrived since its last write (up
//! to [`MAX_ITEMS`] or [`MAX_BYTES`]) and writes it in one transaction per
//! batch and lease token. One commit for many items also helps SQLite,
//! whose every commit is a sync to disk.

use crate::batch::store::{Finished, Store, StoreError};
use std::collections::BTreeMap;
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot};

/// Results in one write at most.
const MAX_ITEMS: usize = 512;
/// Bytes of result lines in one write at most (a write's statement stays
/// well inside the store's timeout).
const MAX_BYTES: usize = 8 << 20;

/// What a write answers each item: `Ok(None)` when the batch's lease has
/// passed to another replica (nothing written, on a shared store), else
/// whether the item's result is new.
pub type Answer = Result<Option<bool>, Arc<StoreError>>;

struct Put {
    batch: String,
    /// The lease's fencing token the item was sent under.
    token: Option<i64>,
    item: Finished,
    answer: oneshot::Sender<Answer>,
}

/// A handle to the writer; the writer stops when every handle is gone.
#[derive(Clone)]
pub struct Writer {
    tx: mpsc::UnboundedSender<Put>,
}

impl Writer {
    /// Starts the writer on the current runtime; results on a shared
    /// store are written as `holder`'s under their token.
    pub fn start(store: Store, holder: String) -> Writer {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(write(store, holder, rx));
        Writer { tx }
    }

    /// Writes `item`'s result with the next group and waits for the
    /// answer.
    pub async fn put(&self, batch: &str, token: Option<i64>, item: Finished) -> Answer {
        let (answer, rx) = oneshot::channel();
        let put = Put {
            batch: batch.to_string(),
            token,
            item,
            answer,
        };
        if self.tx.send(put).is_err() {
            return Err(Arc::new(StoreError::Poisoned));
        }
        rx.await.unwrap_or(Err(Arc::new(StoreError::Poisoned)))
    }
}

async fn write(store: Store, holder: String, mut rx: mpsc::UnboundedReceiver<Put>) {
    while let Some(first) = rx.recv().await {
        let mut bytes = first.item.result.text.len();
        let mut group = vec![first];
        while group.len() < MAX_ITEMS && bytes < MAX_BYTES {
            let Ok(p) = rx.try_recv() else { break };
            bytes += p.item.result.text.len();
            group.push(p);
        }
        for ((batch, token), puts) in by_lease(group) {
            let items: Vec<Finished> = puts.iter().map(|p| p.item.clone()).collect();
            let holder = holder.clone();
            let answer = store
                .run(move |s| {
                    s.put_finished_as(&batch, &items, token.map(|t| (holder.as_str(), t)))
                })
                .await;
            answer_each(puts, answer);
        }
    }
}

/// The group split by batch and lease token (one transaction each), in
/// the order they arrived within each.
fn by_lease(group: Vec<Put>) -> BTreeMap<(String, Option<i64>), Vec<Put>> {
    let mut out: BTreeMap<(String, Option<i64>), Vec<Put>> = BTreeMap::new();
    for p in group {
        out.entry((p.batch.clone(), p.token)).or_default().push(p);
    }
    out
}

fn answer_each(puts: Vec<Put>, answer: Result<Option<Vec<bool>>, StoreError>) {
    match answer {
        Ok(None) => {
            for p in puts {
                let _ = p.answer.send(Ok(None));
            }
        }
        Ok(Some(new)) => {
            for (i, p) in puts.into_iter().enumerate() {
                let _ = p
                    .answer
                    .send(Ok(Some(new.get(i).copied().unwrap_or(false))));
            }
        }
        Err(e) => {
            let e = Arc::new(e);
            for p in puts {
                let _ = p.answer.send(Err(e.clone()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::store::ItemResult;

    fn finished(line: u64, ok: bool) -> Finished {
        Finished {
            result: ItemResult {
                line,
                ok,
                text: format!("{{\"line\":{line}}}"),
                gpu_seconds: 0.5,
                missed: false,
            },
            input_tokens: 10,
            output_tokens: 3,
        }
    }

    /// Many items handing results over at once: each is answered once,
    /// new the first time and not the second, and the batch counts each
    /// once with its tokens.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn results_handed_over_together_are_each_written_and_counted_once() {
        let store = Store::temporary().unwrap();
        let mut up = store.upload("file-a");
        for i in 0..300 {
            let line = up.line(i, i + 1, &format!("c{i}"), "{}").unwrap();
            assert_eq!(line, None);
        }
        let file = crate::batch::FileRow::example("file-a", 300);
        assert_eq!(up.commit(&file).unwrap(), None);
        let b = crate::batch::BatchRow::example("batch_a", "file-a", 300);
        assert!(store.insert_batch(&b).unwrap());
        let w = Writer::start(store.clone(), "r".into());
        let mut hs = Vec::new();
        for line in 0..300u64 {
            let w = w.clone();
            hs.push(tokio::spawn(async move {
                w.put("batch_a", None, finished(line, line % 7 != 0)).await
            }));
        }
        for h in hs {
            assert_eq!(h.await.unwrap().unwrap(), Some(true));
        }
        // Again: had a result already.
        assert_eq!(
            w.put("batch_a", None, finished(5, true)).await.unwrap(),
            Some(false)
        );
        let b = store.batch("batch_a").unwrap().unwrap();
        let failed = (0..300).filter(|l| l % 7 == 0).count() as u64;
        assert_eq!(
            (b.counts.completed, b.counts.failed),
            (300 - failed, failed)
        );
        assert!((b.gpu_seconds - 150.0).abs() < 1e-6, "{}", b.gpu_seconds);
        assert_eq!(
            store.results("batch_a", true, 0, 1000).unwrap().len() as u64,
            300 - failed
        );
    }
}

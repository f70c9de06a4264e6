//! Mesh benchmark (work in progress): fleet sizing probe.
use dramesh_store::*;
fn rss() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    s.lines().find(|l| l.starts_with("VmRSS")).unwrap().split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}
fn main() {
    let nodes: usize = std::env::var("N").ok().and_then(|s| s.parse().ok()).unwrap_or(1000);
    let k: usize = std::env::var("K").ok().and_then(|s| s.parse().ok()).unwrap_or(3);
    let specs = dramesh_sim::uniform_fleet(k, nodes, 0.5);
    let r0 = rss();
    let mut agent = Store::in_memory(StoreConfig { durability: Durability::None, ..Default::default() });
    let mut replica = Store::in_memory(StoreConfig { durability: Durability::None, ..Default::default() });
    let mut msgbytes = 0;
    for spec in &specs {
        let c = dramesh_sim::generate(spec);
        let t = std::time::Instant::now();
        let doc = DocId::new(c.name.clone(), "dir-agent");
        agent.open_writer(&doc).unwrap();
        let changes: Vec<_> = c.objects.iter().map(ObjectChange::upsert).collect();
        agent.apply(&doc, changes).unwrap();
        let ta = t.elapsed();
        let g = agent.doc_summary(&doc).unwrap().generation;
        let (mut sa, mut sr) = (SyncState::new(), SyncState::new());
        let t = std::time::Instant::now();
        for _ in 0..10 {
            let mut any = false;
            if let Some(m) = agent.generate_sync_message(&doc, g, &mut sa).unwrap() { msgbytes += m.len(); any = true; replica.receive_sync_message(&doc, g, &mut sr, &m, &|_| true).unwrap(); }
            if let Some(m) = replica.generate_sync_message(&doc, g, &mut sr).unwrap() { msgbytes += m.len(); any = true; agent.receive_sync_message(&doc, g, &mut sa, &m, &|_| true).unwrap(); }
            if !any { break; }
        }
        println!("{}: agent apply {ta:?}, replica sync {:?}, rss {} MB", c.name, t.elapsed(), (rss() - r0) >> 20);
    }
    println!("msg bytes {msgbytes}");
}

fn main() {
    let p = std::env::args().nth(1).unwrap();
    let text = std::fs::read_to_string(&p).unwrap();
    let sc: tierkv_sim::scenario::Scenario = serde_json::from_str(&text).unwrap();
    let a = serde_json::to_string(&sc).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let b = serde_json::to_string(&v).unwrap();
    println!("{:#x} {}", sc.fingerprint(), a == b);
    for (i, (x, y)) in a.chars().zip(b.chars()).enumerate() {
        if x != y {
            println!(
                "diff at {i}: {} | {}",
                &a[i.saturating_sub(80)..(i + 80).min(a.len())],
                &b[i.saturating_sub(80)..(i + 80).min(b.len())]
            );
            break;
        }
    }
}

//! Prints a GGUF file's metadata (arrays abbreviated) and tensor table.
fn main() {
    let path = std::env::args().nth(1).expect("usage: gguf_dump FILE");
    let g = trellm_formats::gguf::Gguf::open(std::path::Path::new(&path)).unwrap_or_else(|e| {
        eprintln!("error: {e}");
        std::process::exit(1)
    });
    for (k, v) in &g.metadata {
        match v {
            trellm_formats::gguf::Value::Array(a) => {
                println!("{k} = [{} items] {:?}", a.len(), a.prefix(5))
            }
            trellm_formats::gguf::Value::Str(s) if s.len() > 200 => {
                println!("{k} = {}", trellm_formats::quote_max(s, 200))
            }
            v => println!("{k} = {v:?}"),
        }
    }
    for t in &g.tensors {
        println!("{} {:?} {:?}", t.name, t.shape, t.ty);
    }
}
